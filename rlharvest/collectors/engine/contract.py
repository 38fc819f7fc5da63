"""What a collector with workers hands its engine, written down as a Protocol (docs/architecture.md).

Each options class (``collectors/options/``: ``mp.py``, ``nodes.py`` and the node backends,
``async_batched.py``) is one frozen dataclass that satisfies :class:`EngineOptions`: besides the
collector's validated arguments it hands over ready objects, not flags to interpret: how batches
gather (:class:`~.gather.Gathering`), when weights are pushed (:class:`~.schedule.WeightPushes`), how the
collector runs free (:class:`~.running.FreeRun`), the parts its backend adds (:class:`~.extras.EngineExtra`),
how trajectory ids stay unique (:class:`~.traj_ids.TrajectoryIds`), when ``stats()`` asks the workers
(:class:`~.stats.WorkerCensus`). Whether a worker can be replaced is its backend's
(``Backend.replaceable``). :class:`~.engine.CollectionEngine` reads nothing else of its options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ...config import CollectorConfig
from ...config_views import BatchShares
from ...protocol import WorkerSpec
from ...transport.base import Backend
from ..options.autoscale import Autoscale
from .extras import EngineExtra
from .fleet import Fleet
from .gather import Gathering
from .running import FreeRun
from .schedule import WeightPushes
from .served import PolicyServer
from .events import FleetEvents
from .state import Lifecycle
from .stats import WorkerCensus
from .traj_ids import TrajectoryIds

__all__ = ["EngineOptions", "Startup", "WorkerSetup"]


@dataclass(frozen=True)
class Startup:
    """How a collector's workers start."""

    wait_until_built: bool = True
    """The constructor returns once every worker is built (False: the first use waits for them)."""
    deferred: bool = False
    """Workers join later (``launcher="external"``): they are awaited at the first use."""


@dataclass(frozen=True)
class WorkerSetup:
    """What a collector's worker specs are built with, decided once its backend exists."""

    policy: Any
    """The policy each worker is given (a stateless copy when its weights arrive through a scheme)."""
    schemes: dict
    """The sender schemes ``{model_id: scheme}`` feeding the workers (a legacy updater's transport too)."""
    legacy: bool = False
    """A legacy ``weight_updater`` drives the schemes (``update_policy_weights_`` goes through it)."""
    trajectory_counter: Any = None
    """The trajectory-id counter the workers share, or None when each counts its own."""
    inference: Any = None
    """The channels of a policy served in the collector's process (``AsyncBatchedCollector``): each
    worker's policy is a client of it."""


class EngineOptions(Protocol):
    """What :class:`~.engine.CollectionEngine` reads of a collector's options."""

    @property
    def config(self) -> CollectorConfig:
        """The arguments every collector shares, validated."""

    @property
    def noun(self) -> str:
        """How messages name a worker (``"worker"``, ``"node"``, ``"actor"``)."""

    @property
    def num_workers(self) -> int: ...

    @property
    def worker_timeout(self) -> float: ...

    @property
    def shutdown_timeout(self) -> float: ...

    @property
    def version_tracker(self) -> Any:
        """``track_policy_version``: None, True, or an object with ``version``."""

    @property
    def weight_updater(self) -> Any:
        """A legacy weight updater, or None."""

    @property
    def weight_recv_schemes(self) -> dict | None: ...

    @property
    def policy(self) -> Any:
        """The user's policy (the main-side source of the workers' weights), or None."""

    @property
    def policy_factories(self) -> Sequence[Any] | None: ...

    @property
    def factory_fallback(self) -> bool:
        """``update_policy_weights_()`` without weights reads a factory's policy when there is no policy."""

    @property
    def autoscale(self) -> Autoscale | None: ...

    @property
    def env_fns(self) -> Sequence[Any]:
        """One env constructor per worker."""

    @property
    def assembles_trajectories(self) -> bool:
        """Whether complete trajectories are assembled here (else the workers write their own)."""

    @property
    def workers_write_buffer(self) -> bool: ...

    @property
    def refuses_keep_env(self) -> bool:
        """``shutdown(close_env=False)`` is refused: the workers always close their envs."""

    @property
    def shutdown_after_total(self) -> bool:
        """Iteration shuts the collector down once ``total_frames`` were collected (``RayCollector``)."""

    @property
    def startup(self) -> Startup: ...

    @property
    def gathering(self) -> Gathering:
        """How the workers' batches come back."""

    @property
    def pushes(self) -> WeightPushes:
        """When weights are pushed without being asked."""

    @property
    def free_run(self) -> FreeRun | None:
        """How ``start()`` runs the collector free (None: it cannot)."""

    @property
    def census(self) -> WorkerCensus:
        """When ``stats()`` asks the workers."""

    def trajectory_ids(self) -> TrajectoryIds:
        """How the workers' trajectory ids stay unique across them."""

    def build_backend(self) -> Backend: ...

    def served_policy(self, backend: Backend) -> PolicyServer | None:
        """A policy served in this process to the workers (``AsyncBatchedCollector``), or None."""

    def extras(self, backend: Backend, fleet: Fleet, life: Lifecycle, events: FleetEvents) -> list[EngineExtra]:
        """The parts the backend adds (nodes that join, remote references)."""

    def prepare(self, backend: Backend) -> WorkerSetup:
        """The weight schemes and what the workers are given, once the backend exists."""

    def worker_specs(self, setup: WorkerSetup, shares: BatchShares, first: int = 0) -> list[WorkerSpec]:
        """One spec per worker from index ``first`` on, each with its share of ``shares``."""

    def added(self, first: int, create_env_fn: Any, num_envs: int | None, policy: Any, collector_kwargs: Any,
              backend_options: Any, setup: WorkerSetup, shares: BatchShares) -> tuple[Any, list[WorkerSpec], Any]:
        """``add_collectors``: these options grown, the new workers' specs, what the backend needs."""

    def scaled_backend_options(self, count: int) -> Any:
        """What the backend needs of ``count`` workers the autoscaler adds."""
