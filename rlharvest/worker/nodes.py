"""The entry points of nodes: what a torch.distributed node runs, and the functions an RPC node
serves. They live beside the worker loop they run; backends get them as their targets.

* :func:`node_main` is what every launcher starts (``python -m rlharvest.collectors.distributed.node``
  too): a ``torchdist`` node joins its group and serves the worker loop on its command channel; an
  ``rpc`` node joins the RPC group and waits for the main process's calls.
* :data:`RPC_CALLS` are the functions the main process calls on an RPC node (building its worker,
  one command, an interrupt, weights); they find the node's one worker in this module.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import cloudpickle
import torch

from .._utils import use_worker_scheduling
from ..errors import RemoteFailure
from ..protocol import READY, Reply
from ..transport.rpc_node import RPCNodeCalls, RPCNodeEndpoint, serve_rpc_node
from ..transport.torchdist import DistWorkerEndpoint, join_as_node
from ..transport.keys import NodeCredential
from ..transport.torchdist_join import join_collector
from ..transport.weight_pool import attach_named
from .loop import Worker, run_worker

__all__ = ["node_main", "join_main", "RPC_CALLS"]


def node_main(rank: int, world_size: int, host: str, port: int, backend: str = "gloo",
              framework: str = "distributed", **kwargs: Any) -> None:
    """The entry point of every node: its rank, the world size, the main process's address; the rest
    of its configuration arrives from the main process.

    Args:
        rank: the node's rank (node ``i`` of a collector is rank ``i + 1``).
        world_size: number of nodes + 1.
        host, port: the main process's address and the collector's ``tcp_port``.
        backend: the process-group backend.
        framework: ``"distributed"`` (DistributedCollector) or ``"rpc"`` (RPCCollector).
        **kwargs: start arguments from the launcher (key, timeouts, generation, ...).
    """
    use_worker_scheduling()  # before the store, gloo or RPC start their threads: they inherit it
    torch.set_num_threads(1)
    if framework == "rpc":
        serve_rpc_node(rank, host, port, RPC_CALLS, **kwargs)
        return
    endpoint, payload = join_as_node(rank, world_size, host, port, backend, **kwargs)
    _serve(endpoint, payload, rank - 1)


def join_main(host: str, port: int, authkey: NodeCredential | bytes, **kwargs: Any) -> None:
    """The entry point of a node that joins a running collector (``launcher="external"``): it is given
    an empty slot (or refused: :class:`~rlharvest.transport.torchdist_join.JoinRefused`), then serves
    it like any node (``python -m rlharvest node --join HOST:PORT --key-file PATH``)."""
    use_worker_scheduling()
    torch.set_num_threads(1)
    seat = join_collector(host, port, authkey, **kwargs)
    endpoint = DistWorkerEndpoint(seat.conn, seat.group, seat.index, seat.heartbeat_interval, seat.store, seat.key)
    _serve(endpoint, seat.payload, seat.index)


def _serve(endpoint, payload: bytes, index: int) -> None:
    """Run the worker loop of the spec the main process sent, on ``endpoint``."""
    rank = index + 1
    try:
        # The spec names the env constructors and the policy by reference: a node whose sys.path
        # lacks their module must say so to the main process, not only in its own log.
        spec = cloudpickle.loads(payload)  # authenticated bytes from the main process
    except BaseException as err:
        endpoint.send(Reply(READY, rank - 1, failure=RemoteFailure.capture(err, rank - 1)))
        endpoint.close()
        return
    torch.set_num_threads(max(1, int(spec.num_threads)))
    try:
        run_worker(spec, endpoint)
    finally:
        endpoint.close()


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
