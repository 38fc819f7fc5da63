"""The options of ``Collector``: its arguments parsed and validated once, in the process that builds it.

A worker process, a node or a Ray actor running a ``Collector`` receives these options typed, inside
its :class:`~rlharvest.protocol.WorkerSpec` (built by its parent's options, ``mp.py`` and
``nodes.py``): it never parses keyword arguments again (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from ..._utils import user_stacklevel
from ...config import CollectorConfig
from ...config_views import FramesPerBatch
from ...weight_update.torchrl_schemes import own_schemes

__all__ = ["LocalOptions"]


@dataclass(frozen=True)
class LocalOptions:
    """What a ``Collector`` is built from, validated (docs/collection.md)."""

    config: CollectorConfig
    """The arguments every collector shares."""
    create_env_fn: Any
    """The env, or a callable building it."""
    policy: Any = None
    """The policy (None: random actions, or the factory's)."""
    policy_factory: Any = None
    """A zero-argument callable building the policy (exclusive with ``policy``)."""
    weight_updater: Any = None
    weight_sync_schemes: dict | None = None
    weight_recv_schemes: dict | None = None
    trajectory_counter: Any = None
    """Where trajectory ids come from when the collector shares them with others (a worker of a
    collector with one counter for all); None: its own counter."""
    served_by: Any = None
    """An inference client: the policy runs in the parent's process, which serves whichever envs are
    ready (``AsyncBatchedCollector``'s workers); None: the collector runs its policy itself."""

    @classmethod
    def parse(cls, owner: str, *, create_env_fn: Any, policy: Any, policy_factory: Any, backend: Any,
              reset_when_done: bool, weight_updater: Any, weight_sync_schemes: dict | None,
              weight_recv_schemes: dict | None, local_init_rb: bool | None, unknown: dict,
              **config_arguments: Any) -> LocalOptions:
        """Validate a ``Collector``'s constructor arguments, once.

        Raises:
            TypeError, ValueError, RuntimeError: naming the argument that does not fit.
        """
        if unknown:
            raise TypeError(f"{owner} got unexpected keyword argument(s) {sorted(unknown)}.")
        if not reset_when_done:
            raise ValueError("reset_when_done=False is not supported (collectors always reset finished envs).")
        if policy is not None and policy_factory is not None:
            raise TypeError("policy_factory cannot be used together with policy.")
        weight_sync_schemes = own_schemes(weight_sync_schemes, "weight_sync_schemes")
        weight_recv_schemes = own_schemes(weight_recv_schemes, "weight_recv_schemes", receiving=True)
        if weight_updater is not None and weight_sync_schemes:
            raise TypeError("Pass either weight_updater or weight_sync_schemes, not both.")
        if local_init_rb is False:  # the old per-collector initialisation; storage-level init is all there is
            warnings.warn("local_init_rb=False is deprecated and ignored (buffers are always initialised by their "
                          "storage).", FutureWarning, stacklevel=user_stacklevel())
        if isinstance(create_env_fn, (list, tuple)):  # Collector(backend="direct") takes a list of one
            if len(create_env_fn) != 1:
                where = f"backend={backend!r}" if backend is not None else owner
                raise ValueError(f"{where} needs exactly one env constructor, got {len(create_env_fn)}.")
            create_env_fn = create_env_fn[0]
        frames = FramesPerBatch.parse(config_arguments.pop("frames_per_batch", None))
        if frames.per_worker:
            raise TypeError(f"{owner} collects batches of one size: frames_per_batch must be a positive int, got "
                            f"{list(frames.value)} (a list gives one value per worker, to a collector with workers).")
        config = CollectorConfig.from_kwargs(owner, frames_per_batch=frames.value, **config_arguments)
        return cls(config=config, create_env_fn=create_env_fn, policy=policy, policy_factory=policy_factory,
                   weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
                   weight_recv_schemes=weight_recv_schemes)

    def with_hooks(self, hooks: dict) -> LocalOptions:
        """These options with the pre/post-collect ``hooks`` (``{name: hook}``) set."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **hooks))

    def in_worker(self, *, create_env_fn: Any, policy: Any, policy_factory: Any, worker_idx: int) -> LocalOptions:
        """The options a worker builds its ``Collector`` from: its env constructor and policy (made in
        the worker: a stateless copy that receives its weights), its index."""
        return dataclasses.replace(self, create_env_fn=create_env_fn, policy=policy, policy_factory=policy_factory,
                                   config=dataclasses.replace(self.config, worker_idx=worker_idx))
