"""The options of ``DistributedCollector`` and ``DistributedSyncCollector``: nodes in torch.distributed
process groups, started by a launcher or joining from anywhere (docs/collection.md, docs/elastic.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...transport.base import Backend
from ...transport.torchdist import TorchDistBackend
from ...transport.launchers import DEFAULT_SLURM_CONF, LAUNCHERS
from ...transport.rendezvous import PAIR_BACKENDS, check_backend
from ...weight_update.torchdist import DistributedWeightSyncScheme
from ...worker.nodes import node_main
from ..engine.contract import Startup
from ..engine.extras import EngineExtra, ExternalJoins
from ..engine.fleet import Fleet
from ..engine.gather import Gathering, PushedBatches
from ..engine.running import FreeRun
from ..engine.schedule import WeightPushes
from ..engine.events import FleetEvents
from ..engine.state import Lifecycle
from .common import has_weights
from .network import NetworkConfig
from .nodes import NodeOptions

__all__ = ["TorchDistOptions", "EXTERNAL", "check_launcher", "check_external"]

#: the launcher that starts no node: nodes join from anywhere (``join_command()``, docs/elastic.md)
EXTERNAL = "external"


def check_launcher(launcher: str, external: bool = False) -> None:
    """Raises: ValueError for an unknown launcher; ImportError when a SLURM launcher lacks submitit."""
    allowed = list(LAUNCHERS) + ([EXTERNAL] if external else [])
    if launcher not in allowed:
        raise ValueError(f"launcher must be one of {allowed}, got {launcher!r}")
    if launcher in ("submitit", "submitit_delayed"):
        try:
            import submitit  # noqa: F401  (only whether it is there)
        except ImportError as err:
            default = " (the default)" if launcher == "submitit" else ""
            raise ImportError(f"launcher={launcher!r}{default} starts the nodes as SLURM jobs, which needs submitit "
                              "(pip install 'rlharvest[slurm]'). To run the nodes on this machine, pass "
                              "launcher='mp'; nodes started by hand on any host join with launcher='external' "
                              "(docs/elastic.md).") from err


def check_external(backend: str, slurm_kwargs: dict | None, mp_start_method: str | None) -> None:
    """``launcher="external"`` starts no node: options about starting nodes do not apply, and a node
    joins into a slot with a group of its own, which only pair backends form.

    Raises:
        ValueError: naming the argument that does not apply.
    """
    if backend not in PAIR_BACKENDS:
        raise ValueError(f"launcher='external' needs backend in {list(PAIR_BACKENDS)} (each joining node forms a group "
                         f"of its own), got backend={backend!r}.")
    if slurm_kwargs:
        raise ValueError("slurm_kwargs does not apply with launcher='external': the collector starts no node "
                         "(start them with collector.join_command()).")
    if mp_start_method is not None:
        raise ValueError("mp_start_method does not apply with launcher='external': the collector starts no node "
                         "(start them with collector.join_command()).")


@dataclass(frozen=True)
class TorchDistOptions(NodeOptions):
    """``DistributedCollector``: nodes in torch.distributed process groups, started by a launcher."""

    launcher: str = "submitit"
    """``"mp"``, ``"submitit"``, ``"submitit_delayed"`` or ``"external"`` (nodes join, docs/elastic.md)."""
    backend: str = "gloo"
    """The process groups' backend (``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"``)."""
    network: NetworkConfig | None = None
    """Addresses, ports, key and timeouts."""
    slurm_kwargs: dict = field(default_factory=dict)
    """``DEFAULT_SLURM_CONF`` with the user's ``slurm_kwargs`` on top."""
    mp_start_method: str | None = None
    free_running: bool = False
    """``DistributedSyncCollector``: the nodes run free during iteration and push every batch."""

    @classmethod
    def parse(cls, owner: str, *, launcher: str, backend: str, tcp_port: Any, bind_address: Any, authkey: Any,
              handshake_timeout: Any, slurm_kwargs: dict | None, mp_start_method: str | None,
              free_running: bool = False, **common: Any) -> TorchDistOptions:
        """Validate ``DistributedCollector``'s arguments, once.

        Raises:
            TypeError, ValueError, RuntimeError, ImportError: naming the argument that does not fit.
        """
        check_launcher(launcher, external=True)
        if launcher == EXTERNAL:
            check_external(backend, slurm_kwargs, mp_start_method)
        check_backend(backend)
        shared = cls.parse_common(owner, launcher=launcher, group_backend=backend, joins=launcher == EXTERNAL,
                                  **common)
        network = NetworkConfig.parse(launcher=launcher, tcp_port=tcp_port, bind_address=bind_address,
                                      authkey=authkey, worker_timeout=shared.worker_timeout,
                                      heartbeat_timeout=shared.heartbeat_timeout, handshake_timeout=handshake_timeout)
        return cls.widened(shared, launcher=launcher, backend=backend, network=network,
                           slurm_kwargs={**DEFAULT_SLURM_CONF, **(slurm_kwargs or {})}, mp_start_method=mp_start_method,
                           free_running=free_running)

    @classmethod
    def parse_free_running(cls, owner: str, *, create_env_fn: Any, total_frames: int, update_interval: int | None,
                           policy: Any, policy_factory: Any, backend: str, **others: Any) -> TorchDistOptions:
        """``DistributedSyncCollector``'s arguments: always synchronous; weights (when the policy has
        some) pushed without acknowledgement every ``update_interval`` batches (default 1).

        Raises:
            RuntimeError: when ``total_frames`` is not divisible by the number of nodes.
        """
        count = len(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else 0
        if count and total_frames is not None and total_frames > 0 and total_frames % count:
            raise RuntimeError(f"total_frames={total_frames} must be divisible by the {count} nodes "
                               "(or -1 for endless collection).")
        # sync=False: nodes pick weights up between two env steps, without acknowledging
        schemes = {"policy": DistributedWeightSyncScheme(backend=backend, sync=False)} if (
            has_weights(policy) or policy_factory is not None) else {}
        return cls.parse(owner, create_env_fn=create_env_fn, total_frames=total_frames, policy=policy,
                         policy_factory=policy_factory, backend=backend, sync=True, update_after_each_batch=False,
                         update_interval=int(update_interval) if update_interval else 1, weight_updater=None,
                         weight_sync_schemes=schemes, weight_recv_schemes=None, replay_buffer=None,
                         free_running=True, **others)

    # ------------------------------------------------------------------ what the engine is handed
    @property
    def gathering(self) -> Gathering:
        """``DistributedSyncCollector``: the nodes run free during iteration, pushing every batch."""
        if self.free_running:
            return PushedBatches(self.worker_timeout, self.noun)
        return super().gathering

    @property
    def pushes(self) -> WeightPushes:
        """Running free, the weights go out without acknowledgement every ``update_interval`` batches."""
        if self.free_running:
            return WeightPushes(every=self.update_interval or 1, free_running=True)
        return super().pushes

    @property
    def free_run(self) -> FreeRun | None:
        """``DistributedSyncCollector`` cannot ``start()``: its nodes run free for iteration already."""
        return None if self.free_running else super().free_run

    @property
    def joins(self) -> bool:
        """Nodes join from anywhere (``launcher="external"``; not the free-running collector's)."""
        return self.launcher == EXTERNAL and not self.free_running

    @property
    def startup(self) -> Startup:
        """Nodes that join are awaited at the first use (the constructor returns before any joined)."""
        return Startup(deferred=self.joins)

    def extras(self, backend: TorchDistBackend, fleet: Fleet, life: Lifecycle, events: FleetEvents) -> list[EngineExtra]:
        """``launcher="external"``: the join key and command, slots filled again by nodes that join."""
        return [ExternalJoins(self.network, backend, fleet, life, events)] if self.joins else []

    @property
    def group_backend(self) -> str | None:
        return self.backend

    def build_backend(self) -> Backend:
        return TorchDistBackend(self.num_workers, node_main, self.network, launcher=self.launcher,
                                backend=self.backend, slurm_kwargs=self.slurm_kwargs,
                                start_method=self.mp_start_method)
