"""The options of ``RayCollector``: one Ray actor per env constructor, wherever the cluster places it
(docs/ray.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..._utils import positive_int
from ...transport.base import Backend
from ...transport.ray import DEFAULT_REMOTE_CONFIG, RayBackend, as_replay_buffer
from ...worker import run_worker
from ..engine.contract import Startup
from ..engine.stats import ASKED_EVERY_TIME, WorkerCensus
from .nodes import NodeOptions, replicated

__all__ = ["RayOptions", "remote_configs_of"]


def remote_configs_of(value: Any, count: int, per: str = "collector") -> list[dict]:
    """``ray.remote`` options for each of ``count`` actors (default ``{"num_cpus": 1}``).

    Raises:
        TypeError: for an entry that is not a dict. ValueError: for a list of another length.
    """
    configs = replicated(DEFAULT_REMOTE_CONFIG if value is None else value, "remote_configs", count, per)
    for config in configs:
        if not isinstance(config, dict):
            raise TypeError(f"remote_configs must be a dict or a list of dicts (ray.remote options), got "
                            f"{type(config).__name__}.")
    return [dict(config) for config in configs]


@dataclass(frozen=True)
class RayOptions(NodeOptions):
    """``RayCollector``: Ray actors, wherever the cluster places them."""

    remote_configs: tuple[dict, ...] = ()
    """``ray.remote`` options of each actor."""
    ray_init_config: dict | None = None
    """``ray.init`` arguments, used only when Ray is not initialised yet."""

    noun = "actor"
    #: iteration releases the actors once ``total_frames`` were collected, as TorchRL's does
    shutdown_after_total = True
    #: every ``stats()`` asks each actor
    census: ClassVar[WorkerCensus] = ASKED_EVERY_TIME

    @classmethod
    def parse(cls, owner: str, *, create_env_fn: Any, num_collectors: int | None, collector_kwargs: Any,
              remote_configs: Any, ray_init_config: dict | None, use_env_creator: bool, no_cuda_sync: bool | None,
              replay_buffer: Any, **common: Any) -> RayOptions:
        """Validate ``RayCollector``'s arguments, once: ``num_collectors`` repeats a single env
        constructor, ``collector_kwargs`` or ``remote_configs`` (``use_env_creator`` is accepted: env
        constructors travel through Ray as they are); a ``replay_buffer`` that is a Ray actor is
        written through its ``extend``.

        Raises:
            TypeError, ValueError: naming the argument that does not fit.
        """
        count = num_collectors
        if count is None:
            count = len(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else 1
        positive_int("num_collectors", count)
        env_fns = replicated(create_env_fn, "create_env_fn", count)
        if not isinstance(collector_kwargs, (list, tuple)):
            collector_kwargs = [dict(collector_kwargs or {}) for _ in range(count)]
        configs = remote_configs_of(remote_configs, count)
        shared = cls.parse_common(owner, create_env_fn=env_fns, collector_kwargs=collector_kwargs,
                                  no_cuda_sync=bool(no_cuda_sync), update_interval=None,
                                  replay_buffer=as_replay_buffer(replay_buffer), **common)
        return cls.widened(shared, remote_configs=tuple(configs), ray_init_config=ray_init_config)

    @property
    def startup(self) -> Startup:
        """Async: iteration starts each actor's first rollout as soon as it is built and yields the first
        batch ready, so the constructor does not wait for the slowest actor (docs/ray.md)."""
        return Startup(wait_until_built=self.sync)

    def added_backend_options(self, backend_options: Any, count: int) -> list[dict]:
        return remote_configs_of(backend_options, count, f"new {self.noun} (one per entry of create_env_fn)")

    def scaled_backend_options(self, count: int) -> list[dict]:
        """Actors the autoscaler adds take the first actor's ``remote_configs``."""
        return [dict(self.remote_configs[0]) for _ in range(count)]

    def build_backend(self) -> Backend:
        return RayBackend(self.num_workers, run_worker, list(self.remote_configs),
                          heartbeat_timeout=self.heartbeat_timeout, start_timeout=self.worker_timeout)
