"""The entry points of nodes: what a torch.distributed node runs, and the functions an RPC node
serves. They live beside the worker loop they run; backends get them as their targets.

* :func:`node_main` is what every launcher starts (``python -m rlharvest.collectors.distributed.node``
  too): a ``torchdist`` node joins its group and serves the worker loop on its command channel; an
  ``rpc`` node joins the RPC group and waits for the main process's calls.
* :data:`RPC_CALLS` are the functions the main process calls on an RPC node (building its worker,
  one command, an interrupt, weights); they find the node's one worker in this module.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import cloudpickle
import torch

from .._utils import use_worker_scheduling
from ..errors import RemoteFailure
from ..protocol import READY, Reply
from ..transport.keys import NodeCredential
from ..transport.rpc_node import RPCNodeCalls, RPCNodeEndpoint, serve_rpc_node
from ..transport.torchdist import DistWorkerEndpoint, join_as_node
from ..transport.torchdist_join import join_collector
from ..transport.weight_pool import attach_named
from .loop import Worker, WorkerEnd, run_worker

__all__ = ["node_main", "join_main", "RPC_CALLS", "Report"]

#: ``report(line)``: what a node started by hand (``rlharvest node``) says of each change of its state
Report = Callable[[str], None]

#: how a node says why it stopped
_ENDS = {
    WorkerEnd.CLOSED: "the collector closed this node (it shut down, or removed this node): exiting",
    WorkerEnd.LEFT: "left the collector on SIGTERM (preempted), after its rollout: exiting",
    WorkerEnd.PARENT_GONE: "lost the collector (its connection closed without a word): exiting",
    WorkerEnd.FAILED: "could not build its env or policy (the collector was told why): exiting",
}


def node_main(rank: int, world_size: int, host: str, port: int, backend: str = "gloo",
              framework: str = "distributed", report: Report | None = None, **kwargs: Any) -> None:
    """The entry point of every node: its rank, the world size, the main process's address; the rest
    of its configuration arrives from the main process.

    Args:
        rank: the node's rank (node ``i`` of a collector is rank ``i + 1``).
        world_size: number of nodes + 1.
        host, port: the main process's address and the collector's ``tcp_port``.
        backend: the process-group backend.
        framework: ``"distributed"`` (DistributedCollector) or ``"rpc"`` (RPCCollector).
        report: told of each change of the node's state (``rlharvest node`` prints them); None: silent.
        **kwargs: start arguments from the launcher (key, timeouts, generation, ...).
    """
    use_worker_scheduling()  # before the store, gloo or RPC start their threads: they inherit it
    torch.set_num_threads(1)
    say = report or _silent
    say(f"connecting to {host}:{port} as node {rank - 1}")
    if framework == "rpc":
        serve_rpc_node(rank, host, port, RPC_CALLS, **kwargs)
        say("the collector released this node: exiting")
        return
    endpoint, payload = join_as_node(rank, world_size, host, port, backend, **kwargs)
    say(f"joined as node {rank - 1} of {world_size - 1} ({host}:{port})")
    _serve(endpoint, payload, rank - 1, say)


def join_main(host: str, port: int, authkey: NodeCredential | bytes, report: Report | None = None,
              **kwargs: Any) -> None:
    """The entry point of a node that joins a running collector (``launcher="external"``): it is given
    an empty slot (or refused: :class:`~rlharvest.transport.torchdist_join.JoinRefused`), then serves
    it like any node (``python -m rlharvest node --join HOST:PORT --key-file PATH``); ``report`` is
    told of each change of its state."""
    use_worker_scheduling()
    torch.set_num_threads(1)
    say = report or _silent
    retrying: list[BaseException] = []

    def on_retry(err: BaseException) -> None:
        if not retrying:  # said once: the state changed from connecting to retrying
            retrying.append(err)
            say(f"nothing answers at {host}:{port} yet ({_reason(err)}): retrying for up to "
                f"{kwargs.get('timeout', 120.0):g} s")

    say(f"connecting to {host}:{port}")
    seat = join_collector(host, port, authkey, on_retry=on_retry, **kwargs)
    of = f" of {seat.slots}" if seat.slots is not None else ""
    say(f"joined as node {seat.index}{of} ({host}:{port})")
    # The collector knows this process has ended when its command socket closes (it cannot wait for a
    # process of another host): a duplicate, never closed, keeps the socket open until the exit closes
    # it, so the collector's shutdown() returns once this node is gone, not when it starts to exit.
    os.dup(seat.conn.fileno())
    endpoint = DistWorkerEndpoint(seat.conn, seat.group, seat.index, seat.heartbeat_interval, seat.store, seat.key)
    _serve(endpoint, seat.payload, seat.index, say)


def _silent(line: str) -> None:
    """A node started by a launcher says nothing: its collector logs what happens to it."""


def _reason(err: BaseException) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__


def _serve(endpoint, payload: bytes, index: int, say: Report = _silent) -> None:
    """Run the worker loop of the spec the main process sent, on ``endpoint``."""
    rank = index + 1
    try:
        # The spec's env constructors and policy travel by reference when a module defines them
        # (cloudpickle): a node whose sys.path lacks that module must say so to the main process,
        # not only in its own log.
        spec = cloudpickle.loads(payload)  # authenticated bytes from the main process
    except BaseException as err:
        endpoint.send(Reply(READY, rank - 1, failure=RemoteFailure.capture(err, rank - 1)))
        endpoint.close()
        say(f"could not load what the collector sent ({type(err).__name__}: {err}): exiting")
        return
    torch.set_num_threads(max(1, int(spec.num_threads)))
    try:
        end = run_worker(spec, endpoint, on_ready=lambda: say(f"collecting as node {index}"))
    finally:
        endpoint.close()
    say(_ENDS[end])


# ---------------------------------------------------------------------------------------------- RPC nodes
# The functions below run on an RPC node. They find its one worker here rather than through an RRef:
# an RRef passed as an argument costs TensorPipe extra fork/confirm messages per call (20% of a
# 1M-parameter weight update). RRefs to the node collectors are what users see (collector_rrefs).
_NODE: dict[str, Any] = {"worker": None, "segments": {}, "replies": 0, "left": False}


def _create_worker(spec_bytes: bytes) -> bool:
    """Build the worker; the node keeps it (the main process's calls find it here)."""
    spec = cloudpickle.loads(spec_bytes)  # torch RPC unpickled this call already: it authenticates nobody
    torch.set_num_threads(max(1, int(spec.num_threads)))
    worker = Worker(spec, RPCNodeEndpoint(spec.worker_idx))
    worker.command_lock = threading.Lock()
    _NODE["worker"] = worker
    return True


def _node_worker() -> Worker:
    worker = _NODE.get("worker")
    if worker is None:
        raise RuntimeError("this node has no collector (not created yet, or already closed)")
    return worker


def _handle(message):
    """One command. RPCs run on a thread pool, so commands are serialised like the push loop's.

    None instead of a reply once the node is leaving (preempted): for a rollout it handed back (no
    partial batch travels) and for commands that arrive after it said goodbye."""
    worker = _node_worker()
    with worker.command_lock:
        if _NODE["left"]:
            return None
        reply = worker.handle(message)
        if worker.handing_back:
            return None
        _NODE["replies"] += 1
        return reply


def _preempt() -> float | None:
    """SIGTERM (the node's main thread): the worker finishes or hands back its rollout within half of
    its grace period; returns the grace period, or None when SIGTERM is not a leave here."""
    worker = _NODE.get("worker")
    if worker is None or worker.spec.preemption_grace is None:
        return None
    worker.preempt()
    return worker.spec.preemption_grace


def _leave(deadline: float) -> tuple[str, int]:
    """Once the command in progress ended (or at ``deadline``): answer no more commands; how the
    rollout in flight ended, and how many replies this node sent."""
    worker = _node_worker()
    acquired = worker.command_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
    try:
        _NODE["left"] = True
        return ("handed back" if worker.handing_back or not acquired else "finished"), _NODE["replies"]
    finally:
        if acquired:
            worker.command_lock.release()


def _interrupt() -> None:
    _node_worker().endpoint.interrupts += 1


def _collector_of():
    return _node_worker().collector


def _apply_weights(model_id: str, version: int, payload, initial: bool = False):
    """Map or take the payload, swap it in (and cascade, unless ``initial``); returns the acknowledgement."""
    scheme = _node_worker().duties.weights.receiver_scheme(model_id)
    gen_id = None
    if isinstance(payload, tuple):  # ("shm", gen_id, handle): a generation of the sender's pool
        _, gen_id, handle = payload
        segments = _NODE["segments"]
        if handle is not None:
            segments[gen_id] = attach_named(handle)
        payload = segments[gen_id][1]
    if initial:  # a replacement's first weights: no update, no version bump
        scheme.apply_initial(payload)
    else:
        scheme.apply_pushed(version, payload)  # fresh tensors or a reserved generation: swapped, not copied
    return version, gen_id


def _release() -> None:
    """The node is closing: its worker goes (and its collector shuts down)."""
    worker = _NODE["worker"]
    _NODE["worker"] = None
    if worker is not None and not worker.closed:
        worker.collector.shutdown(raise_on_error=False)


RPC_CALLS = RPCNodeCalls(create=_create_worker, handle=_handle, interrupt=_interrupt, collector_of=_collector_of,
                         apply_weights=_apply_weights, release=_release, preempt=_preempt, leave=_leave)
