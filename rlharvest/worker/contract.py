"""What the worker loop asks of the collector it serves, written down as Protocols.

``WorkerCollector`` is the collector (TorchRL's API: seeds, checkpoints, resets, shutdown);
``ParentDuties`` is what a worker does for its parent beyond that API (one batch for the parent, the
shared replay buffer, rollouts cut short, the weights' receivers), which the collector's engine
implements and ``BaseCollector.for_parent`` hands over. The loop reads nothing else of either.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from tensordict import TensorDictBase

from ..protocol import Written

__all__ = ["ParentDuties", "WorkerCollector", "WorkerWeights"]


class WorkerWeights(Protocol):
    """The weights of the collector a worker serves, as the worker loop drives them."""

    def set_version(self, version: int) -> None:
        """Start counting policy versions from ``version`` (a replacement joins at the current one)."""

    def poll_receivers(self) -> None:
        """Apply any weight update waiting in a receiver scheme (cheap when none is)."""

    def receiver_waitables(self) -> list:
        """Objects ``multiprocessing.connection.wait`` wakes on when an update arrives."""

    def receiver_scheme(self, model_id: str) -> Any:
        """The receiver scheme of ``model_id`` (a node applies what its reader thread mapped)."""


class ParentDuties(Protocol):
    """What a worker loop asks of the collector it serves beyond TorchRL's API: the collector's engine,
    reached through ``BaseCollector.for_parent`` (docs/architecture.md)."""

    weights: WorkerWeights

    def collect_for_parent(self, random: bool) -> TensorDictBase:
        """One raw batch (random actions if ``random``), the unit of work of a worker."""

    def write_to_replay_buffer(self, buffer: Any, batch: TensorDictBase) -> Written:
        """Write a batch into the replay buffer workers share with their parent; returns what was
        written (its parent's ``stats()`` counts it)."""

    def keep_for_replay_buffer(self, batch: TensorDictBase) -> Written:
        """``batch`` goes to the parent, which allocates the shared buffer's storage from it (a collector
        assembling trajectories keeps what it needs to write them later); returns the trajectories that
        ended in it (its parent's ``stats()`` counts them)."""

    def add_step_check(self, check: Callable[[], bool]) -> None:
        """Call ``check`` between env steps; True ends the rollout early."""

    def write_batches_into(self, buffer: TensorDictBase, batch: TensorDictBase) -> None:
        """Write future batches into ``buffer`` (same layout as ``batch``) when ``batch`` is the
        collector's own output buffer: the transport publishes from ``buffer`` without a copy."""

    def enable_profile(self, config: Any) -> None:
        """Profile the next rollouts as ``config`` says (also once iteration started)."""

    def resize_batches(self, frames: int) -> int:
        """Collect rollouts of ``frames`` frames from the next one on (rounded up to the env batch);
        returns the frames it will collect."""


class WorkerCollector(Protocol):
    """What the worker loop needs from the collector it serves: TorchRL's API, and its duties to a
    parent (``BaseCollector`` implements it)."""

    policy: Any
    env: Any
    for_parent: ParentDuties

    def register_scheme_receiver(self, weight_recv_schemes: dict) -> None: ...
    def set_seed(self, seed: int, static_seed: bool = False) -> int: ...
    def reset(self, *args: Any, **kwargs: Any) -> None: ...
    def state_dict(self, *, env_state: bool = True) -> dict: ...
    def load_state_dict(self, state_dict: dict) -> None: ...
    def cascade_execute(self, attr_path: str, *args: Any, **kwargs: Any) -> Any: ...
    def getattr_env(self, name: str) -> Any: ...
    def time_split(self) -> dict[str, float]: ...
    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None: ...
