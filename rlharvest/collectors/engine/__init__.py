"""The engine behind every public collector, and its parts (docs/architecture.md).

* ``local.py``: :class:`LocalEngine`, the rollout loop in this process (``Collector``), its weights
  (``local_weights.py``).
* ``engine.py``: :class:`CollectionEngine`, every collector with workers, whatever the backend; it wires
  the parts, each given only its collaborators: the fleet (``fleet.py``, ``requests.py``,
  ``restarts.py``, ``events.py``), the loop of batches (``loops.py``, ``gather.py``), the calls asked of
  every worker (``broadcast.py``), the weights (``weights.py``, ``updates.py``, ``schedule.py``,
  ``legacy.py``), membership (``membership.py``, ``extras.py``), trajectory ids (``traj_ids.py``),
  background runs (``running.py``, ``pushed.py``), a policy served here (``served.py``), autoscaling
  (``scaling.py``, ``autoscale.py``), checkpoints (``checkpoint.py``) and ``stats()`` (``stats.py``,
  ``progress.py``, ``worker_figures.py``). What several parts share (the counters, whether the collector
  is open, what a batch holds) is ``state.py``; what the engine reads of its options, ``contract.py``.

A face calls the same parts on either engine: ``updates``, ``calls``, ``background``, ``stats``,
``sizes``, ``weights``, ``output``, ``tally``, ``life``, ``hooks``, ``events``.

The engine knows nothing of TorchRL's class names: the public classes (``collectors/*.py``,
``collectors/distributed/*.py``) are faces that build one from their typed options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..base import BaseCollector
    from .engine import CollectionEngine
    from .local import LocalEngine

__all__ = ["engine_of"]


def engine_of(collector: BaseCollector) -> LocalEngine | CollectionEngine:
    """The engine behind a public collector: the documented hook for tests and tools that look at the
    parts (the fleet's specs, the backend's processes, the weight senders); user code needs none of it.

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> engine_of(Collector(CountingEnv(), frames_per_batch=4)).tally.frames
        0
    """
    return collector._engine
