"""The ``rpc`` backend: nodes driven by torch.distributed.rpc (TensorPipe), the worker loop in *pull* mode.

Each node builds its worker when the main process asks it to, and every command is one RPC that runs
``Worker.handle`` there; batches come back inside the reply (TensorPipe moves tensors without
pickling their data). Futures complete into a wake-up pipe, so the worker pool waits on RPC nodes as
on processes. The functions called on nodes are given to the backend (:class:`RPCNodeCalls`, from
``rlharvest.worker.nodes``); a node's own side is :mod:`rlharvest.transport.rpc_node`. The main process is ``TRAINER_NODE``, node ``i`` starts as
``COLLECTOR_NODE_<i+1>``. The group is *dynamic* (``init_rpc`` without a world size): a replacement
joins with a fresh rank and name once the node it replaces left the membership (TensorPipe keeps
pipes per rank, and a joining node greets every member the store lists).

Security (docs/security.md): torch RPC authenticates nobody: any process that reaches a TensorPipe
port can send requests, which the agent unpickles. With local nodes, the store and every TensorPipe
listener are on loopback (``TP_SOCKET_IFNAME`` is set while the agent starts).

Liveness: an RPC to a dead node fails; the main process also pings nodes while waiting (dead after
``heartbeat_timeout`` without an answer). Nodes ping the main process and exit when it is gone.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import select
import threading
import time
from typing import Any, Sequence

import cloudpickle
import torch.distributed.rpc as rpc
from tensordict import TensorDictBase

from ..errors import RemoteFailure, WorkerError
from ..protocol import LEAVING, READY, Reply, WorkerSpec
from .base import Backend, WorkerHandle
from .launchers import LaunchedNode, NodeTarget, launch_nodes
from .ports import PortInUseError, boot_id, is_loopback, port_is_free
from .rendezvous import (loopback_interface, mark_distributed_state, release_rpc_store, serve_rpc_store,
                         tensorpipe_interface)
from .rpc_node import (_HANDLES, DEFAULT_TENSORPIPE_OPTIONS, TRAINER_NAME, RPCNodeCalls, RPCNodeEndpoint,
                       _boot_id, _close_node, _forget_member, _init_rpc_quietly, _ping, node_name, rpc_options,
                       serve_rpc_node)
from .rpc_refs import NodeRRef
from .rpc_weights import RPCWeightLinks, RPCWeightReceiver, RPCWeightSender

__all__ = [
    "TRAINER_NAME",
    "DEFAULT_TENSORPIPE_OPTIONS",
    "RPCBackend",
    "RPCNodeCalls",
    "RPCNodeEndpoint",
    "RPCWorkerHandle",
    "RPCWeightLinks",
    "RPCWeightSender",
    "RPCWeightReceiver",
    "node_name",
    "rpc_options",
    "serve_rpc_node",
]


class _FailedRPC:
    """Placeholder reply of a request whose RPC failed (the node died or is unreachable)."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id


class RPCWorkerHandle(WorkerHandle):
    """The main process's end of one RPC node: futures completing into a wake-up pipe.

    Args:
        worker_idx: the node's index.
        name: its RPC name.
        launched: how its launcher sees it.
        heartbeat_timeout: seconds a ping may stay unanswered.
        calls: the functions this handle calls on the node.
    """

    def __init__(self, worker_idx: int, name: str, launched: LaunchedNode, heartbeat_timeout: float,
                 calls: RPCNodeCalls) -> None:
        self.worker_idx = worker_idx
        self.name = name
        self.launched = launched
        self.heartbeat_timeout = heartbeat_timeout
        self.calls = calls
        self._creation = None  # the future of the RPC that builds the node's worker
        self.info = None  # the node's RPC worker info, once it joined
        self._replies: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._failed: str | None = None
        self.local = False  # on this host: weights through shared memory
        self._interrupts = 0
        self._ping: Any = None
        self._ping_sent = 0.0
        self._terminated = False
        self._replied = 0  # replies received (a preempted node says how many it sent)
        self._left_as: str | None = None  # how the node left (preempted), once it said so
        self._goodbye_after: int | None = None  # replies to receive before its goodbye is announced
        _HANDLES[name] = self

    def start(self, spec_bytes: bytes, timeout: float) -> None:
        """Have the node build its worker; its READY reply arrives once it is built (or failed)."""
        self._creation = rpc.rpc_async(self.name, self.calls.create, args=(spec_bytes,), timeout=timeout)
        self._creation.add_done_callback(self._built)

    def wait_built(self, timeout: float) -> None:
        """Return once the node's worker exists (built or failed: its READY reply says which).

        Raises:
            WorkerError: when the node died meanwhile.
            TimeoutError: after ``timeout`` seconds.
        """
        future = self._creation
        deadline = time.monotonic() + timeout
        while not future.done():
            if not self.is_alive():
                raise WorkerError(f"the node died while starting: {self.exit_description()}.",
                                  worker_idx=self.worker_idx)
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.worker_idx} did not build its collector within {timeout:g} s.")
            time.sleep(0.005)

    def _built(self, future) -> None:
        try:
            future.wait()
            reply = Reply(READY, self.worker_idx, value="ready")
        except Exception as err:
            failure = WorkerError(f"building its collector failed: {err}", worker_idx=self.worker_idx)
            reply = Reply(READY, self.worker_idx, failure=RemoteFailure.capture(failure, self.worker_idx))
        self._push(reply)

    def _push(self, reply) -> None:
        with self._lock:  # under the lock: terminate() cannot close the pipe in between
            if self._terminated:  # a late reply of a node that is gone: nobody takes it
                return
            self._replies.append(reply)
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")

    def _complete(self, request_id: int, future) -> None:
        try:
            reply = future.value()
        except Exception as err:  # the RPC itself failed (node died, unreachable, ...)
            self._failed = f"its RPC failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
            reply = _FailedRPC(request_id)  # described in recv(): asking the launcher may take a moment
        if reply is None:  # a preempted node handed its rollout back (or had left): no reply
            return
        if isinstance(reply, Reply):
            with self._lock:
                self._replied += 1
        self._push(reply)
        self._announce_goodbye()

    def leaving(self, how: str, replies: int) -> bool:
        """The node is leaving (preempted) after sending ``replies`` replies: its goodbye (a LEAVING
        reply) follows them. Returns whether they all arrived."""
        with self._lock:
            if self._left_as is None:  # the node repeats itself until its replies arrived: announced once
                self._left_as, self._goodbye_after = how, replies
        self._announce_goodbye()
        return self._replied >= replies

    def _announce_goodbye(self) -> None:
        with self._lock:
            due = self._goodbye_after is not None and self._replied >= self._goodbye_after
            if due:
                self._goodbye_after = None
        if due:
            self._push(Reply(LEAVING, self.worker_idx, value=self._left_as))

    def left_as(self) -> str | None:
        return self._left_as

    def _failure_reply(self, request_id: int) -> Reply:
        if self.launched.ended(timeout=2.0):
            self._failed = f"the node died: {self.launched.exit_description()}"
        error = WorkerError(self._failed, worker_idx=self.worker_idx)
        return Reply(request_id, self.worker_idx, failure=RemoteFailure.capture(error, self.worker_idx))

    def send(self, message) -> None:
        if self._terminated:
            raise ConnectionError(f"node {self.worker_idx} was stopped")
        future = rpc.rpc_async(self.name, self.calls.handle, args=(message,), timeout=0)
        future.add_done_callback(lambda fut, rid=message.request_id: self._complete(rid, fut))

    def poll(self, timeout: float = 0.0) -> bool:
        if self._replies:
            return True
        if timeout > 0 and self._wake_r >= 0:
            select.select([self._wake_r], [], [], timeout)
        return bool(self._replies)

    def recv(self):
        with self._lock:
            reply = self._replies.popleft()
            if self._wake_r >= 0:
                os.read(self._wake_r, 1)
        if isinstance(reply, _FailedRPC):
            return self._failure_reply(reply.request_id)
        return reply

    def fileno(self) -> int:
        return self._wake_r

    @property
    def pid(self) -> int | None:
        return self.launched.pid

    def is_alive(self) -> bool:
        if self._terminated or self._failed or not self.launched.is_alive():
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
        if self._creation is not None and not self._failed and not self._terminated:
            self._interrupts += 1
            rpc.rpc_async(self.name, self.calls.interrupt, timeout=self.heartbeat_timeout)

    def interrupt_mark(self) -> int:
        return self._interrupts

    def fetch_batch(self, reply) -> TensorDictBase:
        return reply.value

    def collector_rref(self, timeout: float) -> "NodeRRef":
        return NodeRRef(rpc.remote(self.name, self.calls.collector_of, timeout=timeout), self.name)

    def forget_remote(self) -> None:
        self._ping = None

    def close_node(self, graceful: bool = False) -> None:
        with contextlib.suppress(Exception):
            rpc.rpc_async(self.name, _close_node, args=(graceful,), timeout=self.heartbeat_timeout)

    def terminate(self, deadline: float) -> None:
        self.launched.terminate(deadline)
        self._terminated = True
        if _HANDLES.get(self.name) is self:
            del _HANDLES[self.name]
        with self._lock:  # once: a second close would close whatever reused the descriptor numbers
            fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
            self._replies.clear()  # replies never taken (batches) go with the node
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


# ---------------------------------------------------------------------------------------------- main side
class RPCBackend(Backend):
    """Nodes in a (dynamic) torch RPC group, started through a launcher.

    Args:
        num_workers: how many nodes.
        target: what every node runs (the node entry point, ``rlharvest.worker.nodes.node_main``).
        calls: the functions the main process calls on nodes.
        net: addresses, ports and timeouts (``collectors.options.network.NetworkConfig``).
        launcher: ``"mp"``, ``"submitit"`` or ``"submitit_delayed"``.
        tensorpipe_options: merged over :data:`DEFAULT_TENSORPIPE_OPTIONS`.
        device_maps: TensorPipe device maps (``visible_devices``).
        slurm_kwargs: SLURM parameters of the node jobs; start_method: of ``"mp"`` nodes.
    """

    noun = "node"

    def __init__(self, num_workers: int, target: NodeTarget, calls: RPCNodeCalls, net: Any, *, launcher: str,
                 tensorpipe_options: dict | None = None, device_maps: dict | None = None,
                 slurm_kwargs: dict | None = None, start_method: str | None = None) -> None:
        super().__init__(num_workers)
        self.target, self.calls, self.net, self.launcher = target, calls, net, launcher
        self.tensorpipe_options, self.device_maps = dict(tensorpipe_options or {}), device_maps
        self.slurm_kwargs, self.start_method = slurm_kwargs, start_method
        self.launched: list[LaunchedNode | None] = [None] * num_workers
        self._next_rank = num_workers + 1  # a replacement gets a fresh rank: TensorPipe keeps pipes per rank
        self._tp_interface = loopback_interface() if net.local else None
        self._init_method: str | None = None
        self._store = None
        self._session: dict | None = None
        self._running = False

    @property
    def replaceable(self) -> bool:
        """Nodes started elsewhere (``launcher="submitit_delayed"``) cannot be started again: they only leave."""
        return self.launcher != "submitit_delayed"

    #: nodes can be added to a running collector: each joins the dynamic group with a fresh rank
    growable = True

    def grow(self, count: int, options: Sequence[dict] | None = None) -> None:
        super().grow(count, options)
        self.launched.extend([None] * count)

    def truncate(self, num_workers: int) -> None:
        super().truncate(num_workers)
        del self.launched[num_workers:]

    def _launch(self, index: int, rank: int) -> None:
        net = self.net
        kwargs = {"tensorpipe_options": self.tensorpipe_options, "user_timeout": net.user_timeout,
                  "session": self._session, "tp_interface": self._tp_interface}
        self.launched[index], = launch_nodes(self.launcher, [rank], self.num_workers + 1, net.advertised_host,
                                             net.tcp_port, "gloo", target=self.target, framework="rpc",
                                             slurm_kwargs=self.slurm_kwargs, start_method=self.start_method,
                                             node_kwargs=kwargs, warm_replacements=self.replacements_expected)

    def start_all(self, specs) -> list[RPCWorkerHandle]:
        if rpc.api._is_current_rpc_agent_set():
            raise RuntimeError("torch RPC is already initialised in this process (one RPCCollector at a time: "
                               "shut the other one down first).")
        net = self.net
        if not port_is_free(net.tcp_port, net.bind_host):
            raise PortInUseError(f"tcp_port {net.tcp_port} is already in use: pick another tcp_port, or tcp_port=0 "
                                 "for free ports.")
        self._session = {"init_counter": rpc._init_counter}  # the store prefix every member must agree on
        for spec in specs:
            self._launch(spec.worker_idx, spec.worker_idx + 1)
        self._init_rpc()
        return [self._build(spec, spec.worker_idx + 1) for spec in specs]

    def _init_rpc(self) -> None:
        net = self.net
        self._init_method, self._store = serve_rpc_store(net.bind_host, net.tcp_port, self.num_workers + 1,
                                                      net.worker_timeout)
        options = rpc_options(net.advertised_host, net.tcp_port, self.tensorpipe_options, self.device_maps,
                              init_method=self._init_method)
        mark_distributed_state()
        with tensorpipe_interface(self._tp_interface):
            _init_rpc_quietly(TRAINER_NAME, 0, options)  # a dynamic group: nodes join when they are up
        self._running = True

    def _build(self, spec: WorkerSpec, rank: int) -> RPCWorkerHandle:
        """Wait until the node joined, then have it build its worker (it answers READY once built)."""
        index = spec.worker_idx
        handle = RPCWorkerHandle(index, node_name(rank), self.launched[index], self.net.heartbeat_timeout,
                                 self.calls)
        deadline = time.monotonic() + self.net.worker_timeout
        node_boot = None
        while node_boot is None:  # joined once it answers (its membership reaches us in steps)
            try:
                node_boot = rpc.rpc_sync(handle.name, _boot_id, timeout=self.net.heartbeat_timeout)
            except RuntimeError:
                if not handle.launched.is_alive():
                    raise _died_starting(index, handle.launched) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {index} did not join the RPC group within "
                                       f"{self.net.worker_timeout:g} s.") from None
                time.sleep(0.01)
        handle.info = rpc.get_worker_info(handle.name)
        handle.local = is_loopback(self.net.advertised_host) and node_boot == boot_id()
        handle.start(cloudpickle.dumps(spec), timeout=self.net.worker_timeout)
        self.handles[index] = handle
        return handle

    def start_one(self, index: int, spec: WorkerSpec) -> RPCWorkerHandle:
        """Launch a node in place of node ``index``: it joins the group with a fresh rank.

        Raises:
            NotImplementedError: for nodes started elsewhere (``submitit_delayed``).
        """
        if self.launcher == "submitit_delayed":
            raise NotImplementedError("launcher='submitit_delayed': nodes are started elsewhere, so the collector "
                                      "cannot start one in place of another.")
        rank, self._next_rank = self._next_rank, self._next_rank + 1
        self._launch(index, rank)
        return self._build(spec, rank)

    def stop_one(self, index: int, deadline: float) -> None:
        handle, node = self.handles[index], self.launched[index]
        if handle is not None:
            handle.forget_remote()
            if handle.is_alive():
                handle.close_node()
            handle.terminate(deadline)
            self._close_pipes(handle)
            self._remove_member(handle)
        elif node is not None:
            node.terminate(deadline)

    def retire(self, index: int) -> None:
        self.launched[index] = None  # its launcher's record (a process or a job) goes with it
        super().retire(index)

    def _close_pipes(self, handle: RPCWorkerHandle) -> None:
        """Make TensorPipe close its connections to a node that is gone. It notices a peer that closed
        them only when it uses them: a node that ended gracefully (removed, preempted) would leave this
        process's ends open (CLOSE_WAIT: four descriptors per node) until the agent shuts down. One
        last call, which fails at once (the peer resets the connection), closes them."""
        if getattr(handle, "info", None) is None or not self._running:
            return
        with contextlib.suppress(Exception):
            rpc.rpc_async(handle.name, _ping, timeout=min(2.0, self.net.heartbeat_timeout)).wait()

    def _remove_member(self, handle: RPCWorkerHandle) -> None:
        """Remove a node that is gone from the group, as a graceful leave would have: from the store a
        joining node reads the members from, and from the view of this process and of the others."""
        info = getattr(handle, "info", None)
        if info is None or not self._running:
            return
        prefix = f"rpc_prefix_{self._session['init_counter']}/names"
        members = self._store.get(f"{prefix}/_ALL_WORKER_INFOS").decode()
        self._store.set(f"{prefix}/_ALL_WORKER_INFOS", members.replace(f"{info.name}-{info.id},", ""))
        self._store.delete_key(f"{prefix}/{info.id}")
        _forget_member(info)
        for other in self.handles:
            if other is not None and other is not handle and other.is_alive():
                with contextlib.suppress(Exception):
                    rpc.rpc_sync(other.name, _forget_member, args=(info,), timeout=self.net.heartbeat_timeout)

    def stop_all(self, deadline: float, closing=()) -> None:
        """Non-graceful by design: a graceful shutdown is a barrier that hangs on a dead node, and
        waits for remote-reference bookkeeping that repeated sessions in one process confuse."""
        for handle in self.handles:
            if handle is not None:
                handle.forget_remote()  # no RRef may outlive the RPC agent
                if handle.is_alive():
                    handle.close_node()
        for index in range(self.num_workers):
            handle, node = self.handles[index], self.launched[index]
            end = max(deadline, time.monotonic() + 0.5) if index in closing else time.monotonic()
            if handle is not None:
                handle.terminate(end)
            elif node is not None:
                node.terminate(end)
        self._stop_rpc()

    def _stop_rpc(self) -> None:
        if self._init_method:
            release_rpc_store(self._init_method)
            self._init_method = None
        self._store = None  # its server's sockets and event loop: nothing of the group outlives shutdown()
        if self._running:
            self._running = False
            gc.collect()  # release dropped RRefs before the agent goes away
            with contextlib.suppress(Exception):
                rpc.shutdown(graceful=False)

    def default_scheme(self) -> str:
        return "rpc"

    def weight_links(self) -> RPCWeightLinks:
        return RPCWeightLinks(self.num_workers, self.liveness, handles=self.handles,
                              apply_weights=self.calls.apply_weights)


def _died_starting(index: int, node: LaunchedNode) -> Exception:
    return WorkerError(f"the node died while starting: {node.exit_description()}.", worker_idx=index)
