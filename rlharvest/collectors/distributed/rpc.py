"""RPCCollector: nodes driven over torch.distributed.rpc (TensorPipe), SPEC §4.8.

Everything but the wire is DistributedCollector's: arguments, trajectory ids (``k * W + i``),
automatic weight pushes, launchers and the collector logic of RemoteCollectorBase. Nodes run the
worker loop in pull mode (one RPC per command) and receive weights through RPCWeightSyncScheme.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import cloudpickle
import torch.distributed.rpc as rpc

from ...errors import WorkerError
from ...policies import ExplorationType
from ...transport.ports import PortInUseError, port_is_free
from ...transport.rendezvous import loopback_interface, mark_distributed_state
from ...transport.rpc import (TRAINER_NAME, RPCWorkerHandle, init_rpc_quietly, release_store, rpc_options,
                              rpc_session_state, serve_store, tensorpipe_interface)
from ...transport.rpc import _boot_id
from ...transport.torchdist_weights import boot_id, is_loopback
from ...weight_update.rpc import RPCWeightSyncScheme
from .. import _multi_setup as setup
from .._pool import WorkerPool
from ..single import Collector
from ._network import NetworkConfig
from .generic import DistributedCollector
from .launchers import launch_nodes

__all__ = ["RPCCollector"]


class RPCCollector(DistributedCollector):
    """Collect with one node per env constructor, commanded over torch RPC.

    Takes DistributedCollector's arguments except ``update_interval``, plus:

    Keyword Args:
        visible_devices: one device per node (device map for tensors sent to that node).
        tensorpipe_options: merged over ``{"num_worker_threads": 16, "rpc_timeout": 10000,
            "_transports": ["uv"]}``.
        trajs_per_batch, trajs_per_write, traj_format: batches of complete trajectories, assembled on
            this process from the nodes' batches, as :class:`~rlharvest.collectors.Collector` does
            (docs/trajectories.md).

    ``bind_address`` is where the store listens (DistributedCollector's default: loopback with
    ``"mp"``, where TensorPipe listens on loopback too). torch RPC authenticates nobody, whatever the
    address: see docs/security.md before exposing its ports.

    Remote references to the node collectors are in ``collector_rrefs`` (``collector_infos``
    holds their RPC worker infos), e.g. to attach an ``RPCWeightUpdater``.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = RPCCollector([CountingEnv] * 2, frames_per_batch=10, total_frames=20,
        ...                          launcher="mp", sync=True)                   # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                                  # doctest: +SKIP
        [(2, 5), (2, 5)]
    """

    def __init__(
        self,
        create_env_fn: Sequence[Callable],
        policy: Callable | None = None,
        *,
        policy_factory=None,
        frames_per_batch: int,
        total_frames: int = -1,
        device=None,
        storing_device=None,
        env_device=None,
        policy_device=None,
        max_frames_per_traj: int = -1,
        init_random_frames: int = -1,
        reset_at_each_iter: bool = False,
        postproc=None,
        split_trajs: bool = False,
        exploration_type=ExplorationType.RANDOM,
        collector_class: Any = Collector,
        collector_kwargs=None,
        num_workers_per_collector: int = 1,
        sync: bool = False,
        slurm_kwargs: dict | None = None,
        backend: str = "gloo",
        update_after_each_batch: bool = False,
        max_weight_update_interval: int = -1,
        launcher: str = "submitit",
        tcp_port: int | None = None,
        visible_devices: Sequence | None = None,
        tensorpipe_options: dict | None = None,
        weight_updater=None,
        weight_sync_schemes: dict | None = None,
        weight_recv_schemes: dict | None = None,
        replay_buffer=None,
        worker_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        mp_start_method: str | None = None,
        bind_address: str | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        traj_format: str | None = None,
    ) -> None:
        self._trajectory_options = dict(trajs_per_batch=trajs_per_batch, trajs_per_write=trajs_per_write,
                                        traj_format=traj_format)
        if visible_devices is not None and len(visible_devices) != len(create_env_fn):
            raise ValueError(f"visible_devices must hold one device per node ({len(create_env_fn)}).")
        self.visible_devices = visible_devices
        self.tensorpipe_options = dict(tensorpipe_options or {})
        self.collector_rrefs: list = []
        self.collector_infos: list = []
        super().__init__(
            create_env_fn, policy, policy_factory=policy_factory, frames_per_batch=frames_per_batch,
            total_frames=total_frames, device=device, storing_device=storing_device, env_device=env_device,
            policy_device=policy_device, max_frames_per_traj=max_frames_per_traj,
            init_random_frames=init_random_frames, reset_at_each_iter=reset_at_each_iter, postproc=postproc,
            split_trajs=split_trajs, exploration_type=exploration_type, collector_class=collector_class,
            collector_kwargs=collector_kwargs, num_workers_per_collector=num_workers_per_collector, sync=sync,
            slurm_kwargs=slurm_kwargs, backend=backend, update_after_each_batch=update_after_each_batch,
            max_weight_update_interval=max_weight_update_interval, update_interval=None, launcher=launcher,
            tcp_port=tcp_port, weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
            weight_recv_schemes=weight_recv_schemes, replay_buffer=replay_buffer, worker_timeout=worker_timeout,
            heartbeat_timeout=heartbeat_timeout, mp_start_method=mp_start_method, bind_address=bind_address,
        )

    _stateless_nodes = False  # RPC nodes get the policy with its weights (no initial sync)

    def _setup_schemes(self, weight_updater, schemes) -> None:
        has_weights = setup.has_weights(self.policy) or self.policy_factory is not None
        if weight_updater is None and schemes is None:
            schemes = {"policy": RPCWeightSyncScheme()} if has_weights else {}
        self._legacy = weight_updater is not None
        self._pending_updater = weight_updater
        self._sender_schemes = {} if self._legacy else dict(schemes or {})
        self._weight_sync_schemes = None if self._legacy else self._sender_schemes

    @staticmethod
    def _network(launcher, tcp_port, bind_address, authkey, worker_timeout, heartbeat_timeout,
                 handshake_timeout) -> NetworkConfig:
        return NetworkConfig.parse(launcher=launcher, tcp_port=tcp_port, bind_address=bind_address, authkey=None,
                                   worker_timeout=worker_timeout, heartbeat_timeout=heartbeat_timeout,
                                   needs_key=False)

    # ------------------------------------------------------------------ start-up
    def _start(self, count: int) -> None:
        if rpc.api._is_current_rpc_agent_set():
            raise RuntimeError("torch RPC is already initialised in this process (one RPCCollector at a time: "
                               "shut the other one down first).")
        net = self._net
        if not port_is_free(net.tcp_port, net.bind_host):
            raise PortInUseError(f"tcp_port {net.tcp_port} is already in use: pick another tcp_port, or tcp_port=0 "
                                 "for free ports.")
        self._tp_interface = loopback_interface() if net.local else None
        launched = []
        self._rpc_ready = False
        self._init_method = None
        try:
            launched = launch_nodes(self.launcher, count + 1, net.advertised_host, net.tcp_port, self.backend,
                                    framework="rpc", slurm_kwargs=self.slurm_kwargs,
                                    start_method=self._mp_start_method,
                                    node_kwargs={"tensorpipe_options": self.tensorpipe_options,
                                                 "user_timeout": net.user_timeout, "session": rpc_session_state(),
                                                 "tp_interface": self._tp_interface})
            self._launched = launched
            self._init_rpc(count, net.tcp_port, launched)
            handles = [RPCWorkerHandle(node, node + 1, launched[node], self._heartbeat_timeout) for node in range(count)]
            self._pool = WorkerPool(handles, timeout=self._worker_timeout, noun="node", expect_ready=False)
            self._register_live()
            self._create_workers(handles)
            if is_loopback(self._advertised_host):
                here = boot_id()
                for handle in handles:
                    handle.local = rpc.rpc_sync(handle.name, _boot_id, timeout=self._worker_timeout) == here
            self.collector_infos = [rpc.get_worker_info(h.name) for h in handles]
            self.collector_rrefs = [h.collector_rref(self._worker_timeout) for h in handles]
            for model_id, scheme in self._sender_schemes.items():
                scheme.init_on_sender(model_id=model_id, context=self, num_workers=count)
                scheme.connect()
            if self._legacy:
                self.weight_updater = self._pending_updater
        except BaseException:
            self._abort_start(launched)
            raise

    def _init_rpc(self, count: int, port: int, launched) -> None:
        """Join the RPC world as rank 0, watching the nodes while they start."""
        self._init_method = serve_store(self._bind_host, port, count + 1, self._worker_timeout)
        options = rpc_options(self._advertised_host, port, self.tensorpipe_options, self._device_maps(count),
                              init_method=self._init_method)
        result: dict[str, Any] = {}

        def init() -> None:
            try:
                init_rpc_quietly(TRAINER_NAME, 0, count + 1, options)
            except BaseException as err:  # surfaced below
                result["error"] = err

        mark_distributed_state()
        with tensorpipe_interface(self._tp_interface):
            thread = threading.Thread(target=init, name="rlharvest-rpc-init", daemon=True)
            thread.start()
            deadline = time.monotonic() + self._worker_timeout
            while thread.is_alive():
                thread.join(0.1)
                for node, entry in enumerate(launched):
                    if not entry.is_alive():
                        raise WorkerError(f"the node died while starting: {entry.exit_description()}.",
                                          worker_idx=node)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the nodes did not join the RPC world within {self._worker_timeout:g} s.")
        if "error" in result:
            raise RuntimeError(f"starting torch RPC failed: {result['error']}") from result["error"]
        self._rpc_ready = True

    def _device_maps(self, count: int) -> dict | None:
        if self.visible_devices is None:
            return None
        from ...transport.rpc import node_name

        return {node_name(node + 1): {"cpu": str(device)} for node, device in enumerate(self.visible_devices)}

    def _create_workers(self, handles: list[RPCWorkerHandle]) -> None:
        for node, handle in enumerate(handles):
            handle.start(cloudpickle.dumps(self._node_spec(node)), timeout=self._worker_timeout)
        for node, handle in enumerate(handles):
            future = handle.worker_rref._get_future()
            deadline = time.monotonic() + self._worker_timeout
            while not future.done():
                if not handle.is_alive():
                    raise WorkerError(f"the node died while starting: {handle.exit_description()}.", worker_idx=node)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {node} did not build its collector within {self._worker_timeout:g} s.")
                time.sleep(0.005)
            try:
                future.wait()
            except Exception as err:
                raise WorkerError(f"building its collector failed: {err}", worker_idx=node) from err

    # ------------------------------------------------------------------ shutdown
    def _shutdown_impl(self, timeout: float | None, close_env: bool) -> None:
        try:
            self._close_workers(self._shutdown_timeout if timeout is None else timeout)
        finally:
            self._stop_rpc()

    def _abort_start(self, launched) -> None:
        try:
            super()._abort_start(launched)
        finally:
            self._stop_rpc()

    def _release_workers(self, closed: set[int]) -> None:
        self.collector_rrefs = []
        for worker, handle in enumerate(self._pool.handles):
            handle.forget_remote()  # no RRef may outlive the RPC agent
            if not self._pool.is_dead(worker):
                handle.close_node()

    def _stop_rpc(self) -> None:
        """Non-graceful by design: a graceful shutdown is a barrier that hangs on a dead node, and
        waits for remote-reference bookkeeping that repeated sessions in one process confuse."""
        release_store(getattr(self, "_init_method", None))
        if getattr(self, "_rpc_ready", False):
            self._rpc_ready = False
            self.collector_rrefs = []
            import gc

            gc.collect()  # release dropped RRefs before the agent goes away
            try:
                rpc.shutdown(graceful=False)
            except Exception:
                pass
