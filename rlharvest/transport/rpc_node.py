"""The node side of the ``rpc`` backend (docs/architecture.md), and what both sides of it name.

A node joins the dynamic RPC group as ``COLLECTOR_NODE_<rank>`` (:func:`serve_rpc_node`) and serves
the calls the main process (``TRAINER_NODE``, :mod:`rlharvest.transport.rpc`) makes on it: the
functions of :class:`RPCNodeCalls` and the small ones below (``_ping``, ``_boot_id``,
``_close_node``, ``_forget_member``), found by reference on each side. A preempted node says it
leaves (:func:`_say_leaving`) by calling :func:`_node_leaving` on the main process, which answers
for the handle registered in ``_HANDLES``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed.rpc as rpc
from tensordict import TensorDictBase

from .base import WorkerEndpoint
from .ports import boot_id

__all__ = [
    "TRAINER_NAME",
    "DEFAULT_TENSORPIPE_OPTIONS",
    "RPCNodeCalls",
    "RPCNodeEndpoint",
    "node_name",
    "rpc_options",
    "serve_rpc_node",
]

TRAINER_NAME = "TRAINER_NODE"
DEFAULT_TENSORPIPE_OPTIONS = {"num_worker_threads": 16, "rpc_timeout": 10000, "_transports": ["uv"]}


def node_name(rank: int) -> str:
    return f"COLLECTOR_NODE_{rank}"


@dataclass(frozen=True)
class RPCNodeCalls:
    """The functions the main process calls on a node (they run there, found by reference):
    ``create(spec_bytes)`` builds its worker, ``handle(message) -> reply`` runs one command,
    ``interrupt()``, ``collector_of()`` (for ``collector_rrefs``), ``apply_weights(model_id, version,
    payload, initial) -> (version, generation)``, and ``release()`` when the node closes.

    Preemption (docs/elastic.md), called by the node itself: ``preempt() -> grace`` from its SIGTERM
    handler (the worker finishes or hands back its rollout; None when SIGTERM is not a leave: no
    worker yet, or ``preemption_grace=None``), then ``leave(deadline) -> (how, replies)`` once the
    command in progress ended (``how``: ``"finished"`` or ``"handed back"``; ``replies``: how many
    replies the node sent, which the main process takes before the goodbye)."""

    create: Callable
    handle: Callable
    interrupt: Callable
    collector_of: Callable
    apply_weights: Callable
    release: Callable
    preempt: Callable[[], float | None] = lambda: None  # SIGTERM ends the node at once
    leave: Callable[[float], tuple[str, int]] = lambda deadline: ("finished", 0)


def _init_rpc_quietly(name: str, rank: int, options: rpc.TensorPipeRpcBackendOptions) -> None:
    """``rpc.init_rpc`` of a dynamic group, without the warning torch's own TensorPipe start-up emits."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options)


def rpc_options(host: str, port: int, tensorpipe_options: dict | None, device_maps: dict | None = None,
                init_method: str | None = None):
    """TensorPipe options: ``tensorpipe_options`` merged over the defaults."""
    options = {**DEFAULT_TENSORPIPE_OPTIONS, **(tensorpipe_options or {})}
    if device_maps:
        options["device_maps"] = device_maps
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method or f"tcp://{host}:{port}", **options)


class RPCNodeEndpoint(WorkerEndpoint):
    """Interrupts and progress of a node's worker (set by concurrent RPCs, read between env steps)."""

    def __init__(self, worker_idx: int) -> None:
        self.worker_idx = worker_idx
        self.interrupts = 0
        self._seen = 0
        self.steps = 0

    def recv(self, timeout: float):
        return None

    def send(self, message) -> None:
        return None

    def publish_batch(self, batch: TensorDictBase) -> TensorDictBase:
        return batch  # travels inside the reply

    def interrupted(self) -> bool:
        return self.interrupts != self._seen

    def clear_interrupt(self, mark: int | None = None) -> None:
        self._seen = self.interrupts if mark is None else mark

    def report_progress(self, steps: int) -> None:
        self.steps = steps


_CLOSED: dict[str, threading.Event | None] = {"event": None}


def _ping() -> bool:
    return True


def _boot_id() -> str:
    return boot_id()


def _close_node(graceful: bool = False) -> None:
    event = _CLOSED["event"]
    if event is not None:
        event.set()


def _forget_member(info) -> None:
    """Drop a node that left from this agent's view of the group."""
    rpc.api._get_current_rpc_agent()._update_group_membership(info, [], {}, False)


def serve_rpc_node(rank: int, host: str, port: int, calls: RPCNodeCalls, *, tensorpipe_options: dict | None = None,
                   user_timeout: float = 10.0, session: dict | None = None, tp_interface: str | None = None,
                   **_: Any) -> None:
    """A node's whole life: join the RPC group, serve until the main process closes us or vanishes.

    ``session`` carries the main process's RPC init counter (the store prefix of its group);
    ``tp_interface`` (the loopback interface for local nodes) is where TensorPipe listens.
    """
    if session:
        with rpc._init_counter_lock:
            rpc._init_counter = session["init_counter"]
    closed = _CLOSED["event"] = threading.Event()
    preempted = _on_sigterm(calls, closed)
    if tp_interface is not None:
        os.environ["TP_SOCKET_IFNAME"] = tp_interface  # this process is the node's own
    _init_rpc_quietly(node_name(rank), rank, rpc_options(host, port, tensorpipe_options))
    failures = 0
    try:
        while not closed.wait(1.0):
            try:
                rpc.rpc_sync(TRAINER_NAME, _ping, timeout=user_timeout)
                failures = 0
            except Exception:
                failures += 1
                if failures >= 2:  # the main process is gone: do not linger
                    break
        if preempted:
            _say_leaving(node_name(rank), calls, *preempted[0], user_timeout)
    finally:
        calls.release()
        rpc.shutdown(graceful=False)


def _on_sigterm(calls: RPCNodeCalls, closed: threading.Event) -> list[tuple[float, float]]:
    """Handle SIGTERM on this node (in its main thread): its worker finishes or hands back its
    rollout and the node leaves (:func:`_say_leaving`). Before the worker exists, or with
    ``preemption_grace=None``, SIGTERM ends the node at once, as it always did. Returns the list the
    handler appends ``(when, grace)`` to."""
    preempted: list[tuple[float, float]] = []

    def handler(signum: int, frame: Any) -> None:
        grace = calls.preempt()
        if grace is None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if not preempted:
            preempted.append((time.monotonic(), float(grace)))
        closed.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    return preempted


def _say_leaving(name: str, calls: RPCNodeCalls, since: float, grace: float, timeout: float) -> None:
    """A preempted node's goodbye: once its command in progress ended, tell the main process how it
    left and how many replies it sent, until the main process has received them all (or the grace
    period is over); then the node closes."""
    deadline = since + grace
    how, replies = calls.leave(since + grace * 0.75)
    while True:
        try:
            if rpc.rpc_sync(TRAINER_NAME, _node_leaving, args=(name, how, replies),
                            timeout=max(0.1, min(timeout, deadline - time.monotonic()))):
                return
        except Exception:  # the main process is gone, or did not answer within the grace period
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


#: the main process's handles, by node name: a node that leaves says so to its handle
_HANDLES: dict[str, Any] = {}  # RPCWorkerHandle (rpc.py) by node name: filled by the main process


def _node_leaving(name: str, how: str, replies: int) -> bool:
    """Runs on the main process when node ``name`` leaves (preempted); True once every one of its
    ``replies`` arrived (the node waits for that before it closes)."""
    handle = _HANDLES.get(name)
    return True if handle is None else handle.leaving(how, replies)
