"""What differs between the collectors with workers, written down as data the engine reads.

Each options class (``mp.py``, ``nodes.py``, ``torchdist.py``, ``rpc.py``, ``ray.py``,
``async_batched.py``) says through one :class:`Traits` how its collector gathers batches, where its
hooks run, how it runs free, how trajectory ids are made unique and when weights are pushed by
themselves; the engine (``collectors/engine/``) has one code path per value, never a class per
backend (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Traits", "WeightPushes"]


@dataclass(frozen=True)
class WeightPushes:
    """When the engine pushes the policy's weights to the workers without being asked."""

    before_each_batch: bool = False
    """Before every sync request, or before an async worker is asked again (``update_at_each_batch``,
    ``update_after_each_batch``)."""
    every: int | None = None
    """Every this many yielded batches, to the workers that served them (``update_interval``)."""
    max_interval: int = -1
    """To a worker left without an update for more than this many batches (-1: never;
    ``max_weight_update_interval``)."""
    free_running: bool = False
    """Workers run free during iteration (``DistributedSyncCollector``): the weights are pushed
    without acknowledgement before batches 0, k, 2k, ... (k = ``every``), the version counted here."""
    per_target_counters: bool = False
    """Count batches since each worker's last update (nodes); a checkpoint keeps the counters."""
    name_targets: bool = True
    """A push before a sync batch names the workers it updates (False: one update of every worker)."""
    skip_before_first: bool = False
    """Async: no push before a worker's first rollout (its initial weights are fresh)."""


@dataclass(frozen=True)
class Traits:
    """How one kind of collector with workers behaves (the engine's switches, as data)."""

    noun: str = "worker"
    """How errors and ``stats()`` name a worker: ``"worker"``, ``"node"``, ``"actor"``."""
    sync: bool = True
    """Every batch holds one rollout of every worker (True) or is the first ready (False)."""
    gather: str = "stack"
    """``"stack"`` (one rollout of every worker), ``"first_ready"``, ``"pushed"`` (workers run free during
    iteration) or ``"chunks"`` (flat frames of whichever env workers are ready: ``AsyncBatchedCollector``)."""
    relaunch_after_yield: bool = False
    """Async: ask a worker again only after its batch was yielded (weights the caller pushes after a
    batch reach it first); else it is asked again before the yield and collects while the caller trains."""
    hooks_in_workers: bool = True
    """Pre/post-collect hooks run where rollouts run (False: here, where batches are assembled)."""
    run_free: str | None = None
    """``start()``: None (not supported), ``"thread"`` (a thread here iterates into the buffer),
    ``"workers"`` (workers write an rlharvest buffer themselves; else a thread) or ``"pushed"`` (workers
    push every batch, a thread here writes them)."""
    refuses_keep_env: bool = True
    """``shutdown(close_env=False)`` is refused: workers always close their envs."""
    wait_until_built: bool = True
    """The constructor returns once every worker is built (False: the first use waits for them)."""
    deferred_start: bool = False
    """Workers join later (``launcher="external"``): they are awaited at the first use."""
    shutdown_after_total: bool = False
    """Iteration shuts the collector down once ``total_frames`` were collected (``RayCollector``)."""
    per_worker_ids: bool = False
    """Each worker counts its own trajectory ids, mapped to collector-wide ids here (nodes); else one
    counter is shared by every worker."""
    stats_asks_workers: bool = False
    """Every ``stats()`` asks each worker (with a timeout), and ``workers_alive`` counts who answered."""
    pushes: WeightPushes = WeightPushes()
    """When weights are pushed without being asked."""
    external_joins: bool = False
    """Nodes join from anywhere with the join command (``launcher="external"``): the engine writes the key
    they read and gives empty slots to the nodes that join."""
    remote_references: bool = False
    """Users see a remote reference to each node's collector (RPC's ``collector_rrefs``)."""
    states_only_while_idle: bool = False
    """``state_dict``/``set_seed``/``update_policy_weights_`` are refused: workers never stand still
    (``DistributedSyncCollector``)."""
