"""What happens to a batch between its collection and the caller: post-processing, the replay buffer,
batches of complete trajectories (docs/collection.md, docs/trajectories.md). One place for every
engine."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator

from tensordict import TensorDictBase

from ..._utils import is_private_key
from ...config_views import OutputRules
from ...protocol import Written
from ..trajectories import TrajectoryAssembler
from ..utils import split_trajectories

__all__ = ["BatchOutput", "drop_private_keys"]


def drop_private_keys(batch: TensorDictBase) -> TensorDictBase:
    """``batch`` without the keys with a path part starting with ``_`` (TorchRL hides them too)."""
    private = [k for k in batch.keys(True, True) if is_private_key(k)]
    if not private:
        return batch
    batch = batch.exclude(*private)
    empty = [k for k in batch.keys(True) if isinstance(batch.get(k), TensorDictBase) and is_private_key(k)]
    return batch.exclude(*empty) if empty else batch


class BatchOutput:
    """Post-processing and writing of one collector's batches.

    Args:
        rules: what is done to each batch (``split_trajs``, ``postproc``, ``trajs_per_batch``...).
        assembles: whether this collector assembles complete trajectories itself (False when its
            workers write their own to the replay buffer).
        private_copy: whether a batch must be cloned before it is handed over (the rollout reuses its
            buffer); ``split_trajs`` copies anyway.
    """

    def __init__(self, rules: OutputRules, assembles: bool = True, private_copy: bool = False) -> None:
        self.rules = rules
        self.assembles = assembles
        self.private_copy = private_copy
        #: drop keys with a path part starting with ``_`` from the batches (TorchRL's switch of that name)
        self.exclude_private_keys = True
        self._assembler: TrajectoryAssembler | None = None
        #: frames written to a replay buffer whole by this collector
        self.written_frames = 0
        #: what workers writing the replay buffer themselves reported, summed; each one's steps pending
        self.workers_wrote = Written()
        self.workers_pending: dict[int, int] = {}
        #: each such worker's totals as last counted (its reports come in replies and, read by
        #: ``stats()``, from its transport: both at once may count)
        self.workers_seen: dict[int, Written] = {}
        self._counting = threading.Lock()
        #: held while a batch is written into the replay buffer: a model of the buffer is updated under it
        self.writing = threading.Lock()

    @property
    def trajectories(self) -> TrajectoryAssembler | None:
        """Where complete trajectories are assembled (``trajs_per_batch``, ``replay_write_mode="trajectory"``),
        made on first use."""
        if self._assembler is None and self.rules.assembles_trajectories and self.assembles:
            self._assembler = TrajectoryAssembler.from_config(self.rules)
        return self._assembler

    @property
    def assembler(self) -> TrajectoryAssembler | None:
        """The assembler if one was made (a checkpoint holds what it keeps)."""
        return self._assembler

    def postprocess(self, batch: TensorDictBase, public: bool = False) -> TensorDictBase:
        """``split_trajs`` (or a private copy), then ``postproc``, then private keys dropped (``public``: the
        batch is known to have none, e.g. the rollout's layout has none: ~50 us a batch not spent looking)."""
        rules = self.rules
        if rules.split_trajs and rules.trajs_per_batch is None:  # trajectory batches are split already
            batch = split_trajectories(batch)
        elif self.private_copy:
            batch = batch.clone()
        if rules.postproc is not None:
            batch, public = rules.postproc(batch), False
        return drop_private_keys(batch) if self.exclude_private_keys and not public else batch

    def write(self, buffer: Any, batch: TensorDictBase, hook: Callable | None = None) -> None:
        """Write ``batch`` (post-processed here) into ``buffer``: whole, or its complete trajectories as
        flat steps; ``hook`` sees the batch as written."""
        if not batch.numel():
            return
        batch = self.postprocess(batch)
        if hook is not None:
            hook(batch)
        trajectories = self.trajectories
        with self.writing:
            if trajectories is None:
                buffer.extend(batch)
                self.written_frames += batch.numel()
            else:
                trajectories.write(buffer, batch)

    def wrote(self) -> Written:
        """What this collector wrote to its replay buffer and assembled so far (its workers' not included)."""
        assembler = self._assembler
        if assembler is None:
            return Written(self.written_frames)
        return Written(self.written_frames + assembler.written_frames, assembler.completed_frames,
                       assembler.completed_trajectories, assembler.pending_frames)

    def count_worker(self, worker: int, totals: Written) -> None:
        """``worker``, which writes the replay buffer itself, reported its ``totals``: what they add to
        the last counted is counted (a report seen already, or older, adds nothing)."""
        with self._counting:
            seen = self.workers_seen.get(worker, Written())
            if totals.reports <= seen.reports:
                return
            self.workers_wrote = self.workers_wrote + (totals - seen)
            self.workers_pending[worker] = totals.pending_frames
            self.workers_seen[worker] = totals

    def count_advertised(self, handles: Iterable[tuple[int, Any]]) -> None:
        """Count the totals each ``(worker, handle)`` advertised on its transport (``handle.written()``):
        running free, no reply carries them."""
        for worker, handle in handles:
            totals = handle.written()
            if totals is not None:
                self.count_worker(worker, totals)

    def forget_worker(self, worker: int) -> None:
        """``worker`` is replaced or leaves: its episodes in flight will never end, and the totals of
        the worker taking its place start afresh."""
        with self._counting:
            self.workers_pending.pop(worker, None)
            self.workers_seen.pop(worker, None)

    def progress(self, stepped_frames: int) -> dict[str, int]:
        """``stats()``'s progress figures (TorchRL's next release): ``stepped_frames`` (given: the
        frames collected, plus those workers collected running free), and the complete trajectories' and the replay buffer's, where they are
        assembled and written: here, or in the workers, which report them (docs/restarts.md, "Watching
        a run")."""
        own, workers = self.wrote(), self.workers_wrote
        return {"stepped_frames": int(stepped_frames) + workers.free_frames,
                "trajectory_completed_frames": own.trajectory_frames + workers.trajectory_frames,
                "trajectory_pending_frames": own.pending_frames + sum(self.workers_pending.values()),
                "replay_written_frames": own.frames + workers.frames,
                "completed_trajectories": own.trajectories + workers.trajectories}

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict:
        """The counters behind :meth:`progress`, for a checkpoint (the steps pending are counted from the
        episodes in flight, which a checkpoint keeps or restarts)."""
        assembler, workers = self._assembler, self.workers_wrote
        assembled = [assembler.written_frames, assembler.completed_frames, assembler.completed_trajectories] \
            if assembler is not None else [0, 0, 0]
        return {"written": {"frames": self.written_frames, "assembled": assembled,
                            "workers": [workers.frames, workers.trajectory_frames, workers.trajectories],
                            "workers_free": workers.free_frames,
                            "workers_pending": [[w, p] for w, p in self.workers_pending.items()]}}

    def restore(self, section: dict) -> None:
        """Continue counting from a checkpoint's :meth:`state` (one without it: the counters stay)."""
        state = section.get("written")
        if state is None:
            return
        self.written_frames = int(state["frames"])
        assembler = self.trajectories
        if assembler is not None:
            assembler.written_frames, assembler.completed_frames, assembler.completed_trajectories = \
                (int(value) for value in state["assembled"])
        self.workers_wrote = Written(*(int(value) for value in state["workers"]),
                                     free_frames=int(state.get("workers_free", 0)))
        self.workers_pending = {int(w): int(p) for w, p in state["workers_pending"]}

    def write_steps(self, buffer: Any, batch: TensorDictBase, time_dim: int) -> None:
        """``extend_buffer=False``: one ``add`` per time step (deprecated by TorchRL, kept working)."""
        for t in range(batch.shape[time_dim]):
            buffer.add(drop_private_keys(batch[(slice(None),) * time_dim + (t,)].clone()))
        self.written_frames += batch.numel()

    def deliver(self, batch: TensorDictBase, hook: Callable | None = None, public: bool = False
                ) -> Iterator[TensorDictBase]:
        """The batches the caller gets for ``batch``: itself post-processed, or zero or more batches of
        complete trajectories; ``hook`` sees each collected batch once (``public``: :meth:`postprocess`)."""
        batch = self.postprocess(batch, public)
        if hook is not None:
            hook(batch)
        trajectories = self.trajectories
        if trajectories is None:
            yield batch
        else:
            yield from trajectories.batches(batch)
