"""Nodes driven by torch.distributed.rpc (TensorPipe): the worker loop in *pull* mode.

Each node builds a :class:`~rlharvest.worker.Worker` when the main process asks it to (an RRef
owned by the node), and every command is one RPC that runs ``Worker.handle`` there; batches come
back inside the reply (TensorPipe moves tensors without pickling their data). Futures complete into
a wake-up pipe, so :class:`~rlharvest.collectors._pool.WorkerPool` waits on RPC nodes exactly as
on processes. Names: the main process is ``TRAINER_NODE`` (rank 0), node ``i`` is
``COLLECTOR_NODE_<i+1>``.

Security (docs/security.md): torch RPC has no authentication; any process that reaches a TensorPipe
port can send requests, which the agent unpickles, or crash it with a malformed frame. rlharvest can
only narrow who reaches them: with local nodes, the store and every TensorPipe listener are on
loopback (``TP_SOCKET_IFNAME`` is set to the loopback interface while the agent starts).

Liveness: an RPC to a dead node fails; the main also pings nodes while waiting and declares a node
dead when a ping fails or stays unanswered for ``heartbeat_timeout`` seconds. Nodes ping the main
process the same way and exit when it is gone.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import threading
import time
from typing import Any, Iterator
from urllib.parse import parse_qs, urlparse

import cloudpickle
import torch
import torch.distributed.rpc as rpc
from tensordict import TensorDictBase
from torch.distributed.rendezvous import register_rendezvous_handler

from .._utils import use_worker_scheduling
from ..data.flat import FlatLayout
from ..errors import RemoteFailure, WorkerError
from .base import WeightReceiver, WeightSender, WorkerEndpoint, WorkerHandle
from .rendezvous import store_server
from .weight_pool import GenerationPool, NamedShmAllocator, attach_named, copy_into

__all__ = [
    "TRAINER_NAME",
    "node_name",
    "rpc_options",
    "RPCNodeEndpoint",
    "RPCWorkerHandle",
    "RPCWeightSender",
    "RPCWeightReceiver",
    "run_rpc_node",
    "DEFAULT_TENSORPIPE_OPTIONS",
    "serve_store",
    "release_store",
    "tensorpipe_interface",
]

TRAINER_NAME = "TRAINER_NODE"
DEFAULT_TENSORPIPE_OPTIONS = {"num_worker_threads": 16, "rpc_timeout": 10000, "_transports": ["uv"]}
_NODE: dict[str, Any] = {"worker": None, "closed": None}


def node_name(rank: int) -> str:
    return f"COLLECTOR_NODE_{rank}"


def init_rpc_quietly(name: str, rank: int, world_size: int, options) -> None:
    """``rpc.init_rpc`` without the deprecation warning torch's own TensorPipe start-up emits."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def rpc_options(host: str, port: int, tensorpipe_options: dict | None, device_maps: dict | None = None,
                init_method: str | None = None):
    """TensorPipe options: ``tensorpipe_options`` merged over the defaults (D18)."""
    options = {**DEFAULT_TENSORPIPE_OPTIONS, **(tensorpipe_options or {})}
    if device_maps:
        options["device_maps"] = device_maps
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method or f"tcp://{host}:{port}", **options)


# torch's tcp:// rendezvous would serve rank 0's store on every interface: the main process serves
# its own (store_server) and hands it to init_rpc through this URL scheme.
_SCHEME = "rlharvest"
_STORES: dict[str, Any] = {}
_REGISTERED: list = []


def _store_rendezvous(url: str, **kwargs):
    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    yield _STORES[parsed.netloc], int(query["rank"][0]), int(query["world_size"][0])
    raise RuntimeError("the rlharvest rendezvous cannot be repeated")


def serve_store(bind_host: str, port: int, world_size: int, timeout: float) -> str:
    """Serve rank 0's store on ``bind_host`` only; returns the ``init_method`` that uses it."""
    if not _REGISTERED:
        register_rendezvous_handler(_SCHEME, _store_rendezvous)
        _REGISTERED.append(True)
    token = secrets.token_hex(8)
    _STORES[token] = store_server(bind_host, port, world_size, timeout)
    return f"{_SCHEME}://{token}"


def release_store(init_method: str | None) -> None:
    if init_method:
        _STORES.pop(urlparse(init_method).netloc, None)


@contextlib.contextmanager
def tensorpipe_interface(name: str | None) -> Iterator[None]:
    """TensorPipe listens on the address of ``$TP_SOCKET_IFNAME`` (else of this host's name): set it
    to ``name`` while an agent starts. torch reads it once per process, at the first agent."""
    if name is None:
        yield
        return
    previous = os.environ.get("TP_SOCKET_IFNAME")
    os.environ["TP_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TP_SOCKET_IFNAME", None)
        else:
            os.environ["TP_SOCKET_IFNAME"] = previous


# ---------------------------------------------------------------------------------------------- node side
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


def _create_worker(spec_bytes: bytes):
    """Runs on the node (through ``rpc.remote``): build the worker; the RRef keeps it there."""
    from ..worker import Worker

    spec = cloudpickle.loads(spec_bytes)  # torch RPC unpickled this call already: it authenticates nobody
    torch.set_num_threads(max(1, int(spec.num_threads)))
    worker = Worker(spec, RPCNodeEndpoint(spec.worker_idx))
    worker.command_lock = threading.Lock()
    _NODE["worker"] = worker
    return worker


# The functions below run on the node. They find its one worker in _NODE rather than through the
# worker's RRef: an RRef passed as an argument costs TensorPipe extra fork/confirm messages per call
# (20% of a 1M-parameter weight update). The RRef stays what users see (collector_rrefs).
def _node_worker():
    worker = _NODE.get("worker")
    if worker is None:
        raise RuntimeError("this node has no collector (not created yet, or already closed)")
    return worker


def _handle(message):
    """One command. RPCs run on a thread pool, so commands are serialised like the push loop's."""
    worker = _node_worker()
    with worker.command_lock:
        return worker.handle(message)


def _interrupt() -> None:
    _node_worker().endpoint.interrupts += 1


def _collector_of():
    return _node_worker().collector


def _apply_weights(model_id: str, version: int, payload):
    """Runs on the node: map or take the payload, swap it in, cascade; returns the acknowledgement."""
    collector = _node_worker().collector
    scheme = (collector._receiver_schemes or {}).get(model_id)
    if scheme is None:
        raise KeyError(f"node has no receiver scheme for model {model_id!r}")
    gen_id = None
    if isinstance(payload, tuple):  # ("shm", gen_id, handle): a generation of the sender's pool
        _, gen_id, handle = payload
        segments = _NODE.setdefault("segments", {})
        if handle is not None:
            segments[gen_id] = attach_named(handle)
        payload = segments[gen_id][1]
    scheme.apply_pushed(version, payload)  # fresh tensors or a reserved generation: swapped, not copied
    return version, gen_id


def _boot_id() -> str:
    from .torchdist_weights import boot_id

    return boot_id()


def _ping() -> bool:
    return True


def _close_node(graceful: bool = False) -> None:
    _NODE["graceful"] = graceful
    closed = _NODE["closed"]
    if closed is not None:
        closed.set()


def rpc_session_state() -> dict:
    """torch RPC keeps per-process counters (store prefixes of ``init_rpc`` calls, sequence ids of its
    internal all-gathers) that every participant must agree on. A node is a fresh process, so after a
    first RPC session in the main process it must start from the main's values."""
    from torch.distributed.rpc import api

    with api._all_gather_dict_lock:
        return {"init_counter": rpc._init_counter, "all_gather_ids": dict(api._all_gather_sequence_id)}


def _adopt_session_state(state: dict | None) -> None:
    from torch.distributed.rpc import api

    if not state:
        return
    with rpc._init_counter_lock:
        rpc._init_counter = state["init_counter"]
    with api._all_gather_dict_lock:
        api._all_gather_sequence_id.update(state["all_gather_ids"])


def run_rpc_node(rank: int, world_size: int, host: str, port: int, backend: str = "gloo", *,
                 tensorpipe_options: dict | None = None, user_timeout: float = 10.0, session: dict | None = None,
                 tp_interface: str | None = None, **_) -> None:
    """A node's whole life: join the RPC world, serve until the main process closes us or vanishes.

    ``tp_interface`` (the loopback interface for local nodes) is where TensorPipe listens.
    """
    torch.set_num_threads(1)
    use_worker_scheduling()  # before init_rpc: its threads, which run the worker, inherit the policy
    _adopt_session_state(session)
    closed = threading.Event()
    _NODE["closed"] = closed
    if tp_interface is not None:
        os.environ["TP_SOCKET_IFNAME"] = tp_interface  # this process is the node's own
    init_rpc_quietly(node_name(rank), rank, world_size, rpc_options(host, port, tensorpipe_options))
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
    finally:
        worker = _NODE["worker"]
        _NODE["worker"] = None
        if worker is not None and not worker.closed:
            worker.collector.shutdown(raise_on_error=False)
        del worker
        rpc.shutdown(graceful=False)


# ---------------------------------------------------------------------------------------------- main side
class _FailedRPC:
    """Placeholder reply of a request whose RPC failed (the node died or is unreachable)."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id


class RPCWorkerHandle(WorkerHandle):
    """The main process's end of one RPC node: futures completing into a wake-up pipe."""

    def __init__(self, worker_idx: int, rank: int, launched, heartbeat_timeout: float) -> None:
        self.worker_idx = worker_idx
        self.name = node_name(rank)
        self.launched = launched
        self.heartbeat_timeout = heartbeat_timeout
        self.worker_rref = None
        self._replies: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._failed: str | None = None
        self.local = False  # on this host: weights through shared memory
        self._interrupts = 0
        self._ping: Any = None
        self._ping_sent = 0.0

    def start(self, spec_bytes: bytes, timeout: float) -> None:
        self.worker_rref = rpc.remote(self.name, _create_worker, args=(spec_bytes,), timeout=timeout)

    def _complete(self, request_id: int, future) -> None:
        try:
            reply = future.value()
        except Exception as err:  # the RPC itself failed (node died, unreachable, ...)
            self._failed = f"its RPC failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
            reply = _FailedRPC(request_id)  # described in recv(): asking the launcher may take a moment
        with self._lock:
            self._replies.append(reply)
        os.write(self._wake_w, b"x")

    def _failure_reply(self, request_id: int):
        from ..worker import Reply

        if self.launched.ended(timeout=2.0):
            self._failed = f"the node died: {self.launched.exit_description()}"
        error = WorkerError(self._failed, worker_idx=self.worker_idx)
        return Reply(request_id, self.worker_idx, failure=RemoteFailure.capture(error, self.worker_idx))

    def send(self, message) -> None:
        future = rpc.rpc_async(self.name, _handle, args=(message,), timeout=0)
        future.add_done_callback(lambda fut, rid=message.request_id: self._complete(rid, fut))

    def poll(self, timeout: float = 0.0) -> bool:
        if self._replies:
            return True
        if timeout > 0:
            import select

            select.select([self._wake_r], [], [], timeout)
        return bool(self._replies)

    def recv(self):
        with self._lock:
            reply = self._replies.popleft()
        os.read(self._wake_r, 1)
        if isinstance(reply, _FailedRPC):
            return self._failure_reply(reply.request_id)
        return reply

    def fileno(self) -> int:
        return self._wake_r

    def is_alive(self) -> bool:
        if self._failed or not self.launched.is_alive():
            return False
        now = time.monotonic()
        ping = self._ping
        if ping is not None and ping.done():
            try:
                ping.value()
            except Exception as err:
                self._failed = f"it stopped answering pings ({type(err).__name__})"
                return False
            self._ping = None
        elif ping is not None and now - self._ping_sent > self.heartbeat_timeout:
            self._failed = f"no answer to a ping for {self.heartbeat_timeout:g} s (host unreachable?)"
            return False
        if self._ping is None and now - self._ping_sent > 1.0:
            self._ping_sent = now
            self._ping = rpc.rpc_async(self.name, _ping, timeout=self.heartbeat_timeout)
        return True

    def exit_description(self) -> str:
        if self.launched.ended():
            return self.launched.exit_description()
        return self._failed or "it stopped answering"

    def interrupt(self) -> None:
        if self.worker_rref is not None and not self._failed:
            self._interrupts += 1
            rpc.rpc_async(self.name, _interrupt, timeout=self.heartbeat_timeout)

    def interrupt_mark(self) -> int:
        return self._interrupts

    def fetch_batch(self, reply) -> TensorDictBase:
        return reply.value

    def collector_rref(self, timeout: float):
        return rpc.remote(self.name, _collector_of, timeout=timeout)

    def forget_remote(self) -> None:
        self.worker_rref = None
        self._ping = None

    def close_node(self, graceful: bool = False) -> None:
        try:
            rpc.rpc_async(self.name, _close_node, args=(graceful,), timeout=self.heartbeat_timeout)
        except Exception:
            pass

    def terminate(self, deadline: float) -> None:
        self.launched.terminate(deadline)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------- weights
class RPCWeightSender(WeightSender):
    """Weights ride in an RPC to each targeted node; its return value is the acknowledgement.

    Nodes on this host get a generation of a named shared-memory pool instead of the tensors (one
    copy by the sender whatever the number of local nodes, then a swap on each node).
    """

    def __init__(self, handles: list[RPCWorkerHandle], model_id: str) -> None:
        self.handles = handles
        self.num_workers = len(handles)
        self.model_id = model_id
        self._futures: dict[int, Any] = {}
        self._pool: GenerationPool | None = None
        self._current: dict[int, int] = {}
        self._seen: dict[int, set] = {w: set() for w in range(len(handles))}

    def connect(self, initial) -> None:
        """Nodes received the policy with their spec: nothing to do."""

    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        if self._futures:  # a generation may still be in flight to a node (sync=False)
            self.wait_acks(version - 1, list(self._futures), 120.0)
        local = [w for w in worker_ids if self.handles[w].local]
        generation = self._stage(payload) if local else None
        for worker in worker_ids:
            handle = self.handles[worker]
            body = payload
            if worker in local:
                new = generation.gen_id not in self._seen[worker]
                self._seen[worker].add(generation.gen_id)
                body = ("shm", generation.gen_id, generation.handle if new else None)
            self._futures[worker] = rpc.rpc_async(
                handle.name, _apply_weights, args=(self.model_id, version, body), timeout=0)

    def _stage(self, weights: TensorDictBase):
        if self._pool is None:
            self._pool = GenerationPool(FlatLayout.of(weights), NamedShmAllocator())
        generation, _ = self._pool.acquire(set(self._current.values()))
        copy_into(generation, self._pool.keys, weights)
        return generation

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in worker_ids:
            future = self._futures.pop(worker, None)
            if future is None:
                continue
            handle = self.handles[worker]
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            while not done.wait(0.2):  # wakes as soon as the node answers; checks liveness meanwhile
                if not handle.is_alive():
                    raise WorkerError(f"died while applying new weights: {handle.exit_description()}.",
                                      worker_idx=worker)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {worker} did not acknowledge weights version {version} in time.")
            try:
                _, gen_id = future.wait()
            except Exception as err:
                raise WorkerError(f"applying new weights failed: {err}", worker_idx=worker) from err
            if gen_id is not None:
                self._current[worker] = gen_id


class RPCWeightReceiver(WeightReceiver):
    """Passive: updates are pushed by the sender's RPC (see ``apply_pushed``), never polled."""

    def connect(self, timeout: float):
        return None

    def pending(self) -> bool:
        return False

    def receive(self, timeout: float):
        return None

    def ack(self, version: int) -> None:
        return None
