"""Batches of complete trajectories (``trajs_per_batch``, ``trajs_per_write``, ``traj_format``).

A collector given ``trajs_per_batch`` still collects fixed-size batches (``frames_per_batch`` is then
how often it polls the envs) and hands each one to a :class:`TrajectoryAssembler`. The assembler cuts
a batch into trajectories by ``("collector", "traj_ids")``, keeps the episodes still running until
they end, and releases a trajectory once its last step is done (``("next", "done")``,
``"terminated"`` or ``"truncated"``): as batches of exactly ``trajs_per_batch`` trajectories, or
written to a replay buffer as flat runs of steps. See docs/trajectories.md.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from tensordict import TensorDictBase

from .._utils import MASK, TRAJ_IDS

__all__ = ["TrajectoryAssembler", "TRAJ_FORMATS"]

TRAJ_FORMATS = ("padded", "cat")
#: a trajectory is complete when one of these is set at its last step (root-level done flags)
_END_KEYS = (("next", "done"), ("next", "terminated"), ("next", "truncated"))


class TrajectoryAssembler:
    """Turns collected batches into complete trajectories.

    Args:
        trajs_per_batch: trajectories per batch released by :meth:`batches`.
        traj_format: ``"padded"``: a ``(trajs_per_batch, max_len)`` batch, zero-padded along time, with
            ``("collector", "mask")`` marking the valid steps (non-tensor entries are padded with their
            last value); ``"cat"``: the trajectories one after the other along time, no padding.
        trajs_per_write: trajectories per ``extend`` call in :meth:`write` (None: all that are ready).
        discard_in_flight: forget the episodes still running after every batch (the collector resets
            its envs before the next one, so they can never end).

    Example:
        >>> from tensordict import TensorDict
        >>> assembler = TrajectoryAssembler(2, "cat")
        >>> batch = TensorDict({("collector", "traj_ids"): torch.tensor([0, 0, 1, 1, 2]),
        ...                     ("next", "done"): torch.tensor([False, True, False, True, False])}, [5])
        >>> [out.shape for out in assembler.batches(batch)]
        [torch.Size([4])]
        >>> assembler.in_flight_ids()
        [2]
    """

    def __init__(self, trajs_per_batch: int, traj_format: str = "padded", trajs_per_write: int | None = None,
                 discard_in_flight: bool = False) -> None:
        if traj_format not in TRAJ_FORMATS:
            raise ValueError(f"traj_format must be 'padded' or 'cat', got {traj_format!r}")
        self.trajs_per_batch = int(trajs_per_batch)
        self.traj_format = traj_format
        self.trajs_per_write = trajs_per_write
        self.discard_in_flight = discard_in_flight
        self._in_flight: dict[int, list[TensorDictBase]] = {}
        self._complete: list[TensorDictBase] = []
        #: trajectories that ended so far, and their frames (``stats()``)
        self.completed_trajectories = 0
        self.completed_frames = 0
        #: frames of complete trajectories written to a replay buffer so far
        self.written_frames = 0

    @classmethod
    def from_config(cls, config: Any) -> TrajectoryAssembler:
        """The assembler a collector's :class:`~rlharvest.config_views.OutputRules` ask for."""
        return cls(config.trajs_per_batch or 1, config.traj_format, config.trajs_per_write,
                   discard_in_flight=config.reset_at_each_iter)

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> int:
        """Complete trajectories not handed out yet."""
        return len(self._complete)

    @property
    def pending_frames(self) -> int:
        """Frames of the trajectories that started but have not ended yet."""
        return sum(piece.numel() for pieces in self._in_flight.values() for piece in pieces)

    def in_flight_ids(self) -> list[int]:
        """Ids of the trajectories that started but have not ended yet."""
        return list(self._in_flight)

    def flush(self) -> None:
        """Forget everything held: running episodes and complete trajectories not handed out yet."""
        self._in_flight.clear()
        self._complete.clear()

    def drop_in_flight(self, traj_ids: Iterable[int] | None = None) -> None:
        """Forget running episodes (those with ``traj_ids``, or all): their envs were reset."""
        if traj_ids is None:
            self._in_flight.clear()
            return
        for traj_id in traj_ids:
            self._in_flight.pop(int(traj_id), None)

    # ------------------------------------------------------------------ input
    def ingest(self, batch: TensorDictBase) -> None:
        """Add the steps of ``batch`` (any batch shape) to the trajectories they belong to.

        Steps with trajectory id -1 (a rollout cut short) are not data and are skipped.

        Raises:
            KeyError: when ``batch`` has no ``("collector", "traj_ids")`` entry.
        """
        flat = batch.reshape(-1)
        ids = flat.get(TRAJ_IDS, None)
        if ids is None:
            raise KeyError("trajs_per_batch needs ('collector', 'traj_ids') in every batch (keep track_traj_ids=True "
                           "and do not remove that entry in postproc).")
        ids = ids.reshape(-1).cpu()  # bookkeeping on the CPU; the steps stay where they are
        valid = ids != -1
        # A stable sort groups each trajectory's steps in time order; indexing also copies the steps,
        # so what is kept never aliases a buffer the rollout reuses.
        order = torch.nonzero(valid).reshape(-1) if not bool(valid.all()) else torch.arange(ids.numel())
        order = order[torch.argsort(ids[order], stable=True)]
        if not order.numel():
            return
        flat, ids = flat[order], ids[order]
        if MASK in flat.keys(True, True):  # another layer's mask (preemption) means nothing once -1 steps are gone
            flat = flat.exclude(MASK)
        traj_ids, counts = torch.unique_consecutive(ids, return_counts=True)
        stops = counts.cumsum(0)
        ends = _ended(flat)[stops - 1]
        for traj_id, start, stop, ended in zip(traj_ids.tolist(), (stops - counts).tolist(), stops.tolist(),
                                               ends.tolist()):
            self._add(traj_id, flat[start:stop], ended)
        if self.discard_in_flight:
            self._in_flight.clear()

    def _add(self, traj_id: int, steps: TensorDictBase, ended: bool) -> None:
        pieces = self._in_flight.pop(traj_id, None)
        if pieces is not None:
            pieces.append(steps)
        if not ended:
            self._in_flight[traj_id] = pieces if pieces is not None else [steps]
            return
        trajectory = torch.cat(pieces, 0) if pieces is not None else steps
        self._complete.append(trajectory)
        self.completed_trajectories += 1
        self.completed_frames += trajectory.numel()

    # ------------------------------------------------------------------ output
    def batches(self, batch: TensorDictBase) -> Iterator[TensorDictBase]:
        """Ingest ``batch``, then yield every full batch of ``trajs_per_batch`` complete trajectories."""
        self.ingest(batch)
        while len(self._complete) >= self.trajs_per_batch:
            yield self._take(self.trajs_per_batch)

    def _take(self, count: int) -> TensorDictBase:
        trajectories = self._complete[:count]
        del self._complete[:count]
        if self.traj_format == "cat":
            out = torch.cat(trajectories, 0) if len(trajectories) > 1 else trajectories[0]
            out.names = ["time"]
            return out
        return _padded(trajectories)

    def write(self, buffer: Any, batch: TensorDictBase) -> int:
        """Ingest ``batch``, then write every complete trajectory to ``buffer`` as flat steps,
        ``trajs_per_write`` trajectories per ``extend`` call; returns the number written."""
        self.ingest(batch)
        written = len(self._complete)
        per_write = self.trajs_per_write or written
        while self._complete:
            group = self._complete[:per_write]
            del self._complete[:per_write]
            steps = torch.cat(group, 0) if len(group) > 1 else group[0]
            buffer.extend(_with_leaf_device(steps))
            self.written_frames += steps.numel()
        return written


def _ended(flat: TensorDictBase) -> torch.Tensor:
    """Per step of a flat batch: whether a root-level done flag is set."""
    ended = torch.zeros(flat.shape[0], dtype=torch.bool)
    for key in _END_KEYS:
        flag = flat.get(key, None)
        if isinstance(flag, torch.Tensor):
            ended |= flag.reshape(flat.shape[0], -1).any(-1).cpu()
    return ended


def _padded(trajectories: list[TensorDictBase]) -> TensorDictBase:
    lengths = torch.tensor([t.shape[0] for t in trajectories])
    max_len = int(lengths.max())
    rows = [t if t.shape[0] == max_len else torch.cat([t, _zero_steps(t, max_len - t.shape[0])], 0)
            for t in trajectories]
    out = torch.stack(rows, 0)
    device = out.device if out.device is not None else out.get(TRAJ_IDS).device
    out.set(MASK, (torch.arange(max_len) < lengths.unsqueeze(-1)).to(device))
    out.names = [None, "time"]
    return out


def _zero_steps(trajectory: TensorDictBase, count: int) -> TensorDictBase:
    """``count`` padding steps: tensors are zeros; non-tensor entries repeat the last step's value
    (zero has no meaning for them, and the mask says the steps are padding)."""
    filler = trajectory[-1:].expand(count).clone()
    filler.apply_(torch.Tensor.zero_)
    return filler


def _with_leaf_device(batch: TensorDictBase) -> TensorDictBase:
    """``batch`` with its device set when it has none but all its tensors live on one device (a
    postproc may clear it; buffers that compare devices then see the data where it is)."""
    if batch.device is not None:
        return batch
    devices = {leaf.device for leaf in batch.values(True, True) if isinstance(leaf, torch.Tensor)}
    return batch.to(devices.pop()) if len(devices) == 1 else batch
