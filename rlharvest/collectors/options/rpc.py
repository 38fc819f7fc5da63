"""The options of ``RPCCollector``: nodes in a torch RPC group (TensorPipe), started by a launcher.
torch RPC authenticates nobody: see docs/security.md before exposing its ports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...transport.base import Backend
from ...transport.launchers import DEFAULT_SLURM_CONF
from ...transport.rendezvous import check_backend
from ...transport.rpc import RPCBackend, node_name
from ...weight_update.rpc import RPCWeightSyncScheme
from ...worker.nodes import RPC_CALLS, node_main
from ..engine.extras import EngineExtra, RPCReferences
from ..engine.fleet import Fleet
from ..engine.running import IN_A_THREAD, FreeRun
from ..engine.events import FleetEvents
from ..engine.state import Lifecycle
from .common import has_weights
from .network import NetworkConfig
from .nodes import NodeOptions
from .torchdist import EXTERNAL, check_external, check_launcher

__all__ = ["RPCOptions"]


@dataclass(frozen=True)
class RPCOptions(NodeOptions):
    """``RPCCollector``: nodes in a torch RPC group, started by a launcher."""

    launcher: str = "submitit"
    network: NetworkConfig | None = None
    slurm_kwargs: dict = field(default_factory=dict)
    mp_start_method: str | None = None
    visible_devices: tuple | None = None
    """One device per node (the device map of tensors sent to it)."""
    tensorpipe_options: dict = field(default_factory=dict)
    """Merged over rlharvest's TensorPipe defaults."""

    #: RPC nodes get the policy with its weights (no initial sync)
    stateless_nodes = False

    @classmethod
    def parse(cls, owner: str, *, launcher: str, tcp_port: Any, bind_address: Any, slurm_kwargs: dict | None,
              mp_start_method: str | None, visible_devices: Any, tensorpipe_options: dict | None,
              backend: str = "gloo", **common: Any) -> RPCOptions:
        """Validate ``RPCCollector``'s arguments, once (``backend`` is accepted and unused: TensorPipe
        carries everything; there are no automatic pushes every ``update_interval`` batches).

        Raises:
            TypeError, ValueError, RuntimeError, ImportError: naming the argument that does not fit.
        """
        check_launcher(launcher, external=True)
        if launcher == EXTERNAL:
            check_external(backend, slurm_kwargs, mp_start_method)
        check_backend(backend)
        shared = cls.parse_common(owner, update_interval=None, launcher=launcher, **common)
        count = shared.num_workers
        if visible_devices is not None and len(visible_devices) != count:
            raise ValueError(f"visible_devices must hold one device per node ({count}).")
        network = NetworkConfig.parse(launcher=launcher, tcp_port=tcp_port, bind_address=bind_address, authkey=None,
                                      worker_timeout=shared.worker_timeout,
                                      heartbeat_timeout=shared.heartbeat_timeout, needs_key=False)
        return cls.widened(shared, launcher=launcher, network=network,
                           slurm_kwargs={**DEFAULT_SLURM_CONF, **(slurm_kwargs or {})}, mp_start_method=mp_start_method,
                           visible_devices=tuple(visible_devices) if visible_devices is not None else None,
                           tensorpipe_options=dict(tensorpipe_options or {}))

    @property
    def free_run(self) -> FreeRun | None:
        """RPC nodes only act on calls (nothing runs on a node between two of them): running free, a thread
        here keeps requesting batches, as iteration does."""
        return IN_A_THREAD

    def extras(self, backend: Backend, fleet: Fleet, life: Lifecycle, events: FleetEvents) -> list[EngineExtra]:
        """A remote reference to each node's collector (``collector_rrefs``)."""
        return [RPCReferences(fleet, self.worker_timeout)]

    def default_scheme(self, backend: Backend) -> dict:
        weighted = has_weights(self.policy) or self.policy_factories is not None
        return {"policy": RPCWeightSyncScheme()} if weighted else {}

    def prepare(self, backend: Backend):
        setup = super().prepare(backend)
        if setup.legacy:  # a legacy RPCWeightUpdater talks to the nodes' references itself
            return type(setup)(policy=setup.policy, schemes={}, legacy=True)
        return setup

    def build_backend(self) -> Backend:
        device_maps = None
        if self.visible_devices is not None:
            device_maps = {node_name(node + 1): {"cpu": str(device)} for node, device in enumerate(self.visible_devices)}
        return RPCBackend(self.num_workers, node_main, RPC_CALLS, self.network, launcher=self.launcher,
                          tensorpipe_options=self.tensorpipe_options, device_maps=device_maps,
                          slurm_kwargs=self.slurm_kwargs, start_method=self.mp_start_method)
