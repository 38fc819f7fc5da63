"""Churn: random membership events on a running collector, and what this process holds meanwhile.

Shared by the churn tests (``tests/collectors/test_churn.py``, ``tests/collectors/distributed/
test_churn_nodes.py``) and the soak (``benchmarks/soak.py``). Everything goes through the collectors'
public API (``active_workers``, ``worker_pids()``, ``add_collectors``, ``remove_collectors``,
``update_policy_weights_``, ``restart_causes``, ``stats()``), so the tests hold whatever the
collector classes are made of.

* :class:`Churn` draws one event at a time, seeded: SIGKILL or SIGTERM of a worker (its process, found
  with ``worker_pids()``, or for a Ray actor with ``pid_of``), ``add_collectors`` or
  ``remove_collectors``, within a range of worker counts.
* :class:`FrameCheck` checks every yielded batch of CountingEnv driven by ``echo_weight_policy``:
  within a trajectory the counter goes up by one (no frame lost, doubled or torn), every frame was
  collected with weights that were sent, and the frames add up.
* :func:`resources` samples this process: open descriptors (``held.open_fds``), shared memory it maps
  (count and bytes), RSS, threads, child processes (``process_check.children``); :func:`shm_names` the
  ``/dev/shm`` segments a process maps.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import psutil
import torch
from held import open_fds, start_process_state  # noqa: F401  (the churn tests and the soak import them from here)
from process_check import children

#: a frame's weights are among those of the last updates (a batch in flight may predate a few)
RECENT_WEIGHTS = 16
#: every event :class:`Churn` may draw
EVENTS = ("kill", "term", "add", "remove")
IDS = ("collector", "traj_ids")


@dataclass
class Churn:
    """Random membership events on ``collector``, through its public API.

    Args:
        collector: a running collector with workers and restarts on (a killed or preempted worker is
            replaced).
        make_env: the env constructor of added workers.
        seed: seeds the draws (which event, which worker).
        events: the events to draw from (a subset of :data:`EVENTS`).
        workers: ``(fewest, most)`` active workers: ``remove`` is not drawn at the fewest, ``add`` not
            at the most.
        pid_of: ``pid_of(collector, worker)``, the process id of a worker (default: ``worker_pids()``).
        after: ``after(event)``, called after each event (a node joins after a departure, for nodes
            that join from elsewhere: ``launcher="external"``).
    """

    collector: Any
    make_env: Callable
    seed: int = 0
    events: Sequence[str] = EVENTS
    workers: tuple[int, int] = (1, 3)
    pid_of: Callable[[Any, int], int | None] | None = None
    after: Callable[[str], None] | None = None
    done: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = set(self.events) - set(EVENTS)
        if unknown:
            raise ValueError(f"events must be among {EVENTS}, got {sorted(unknown)}")
        self.rng = random.Random(self.seed)
        self._signalled: set[int] = set()

    def _pid(self, worker: int) -> int | None:
        if self.pid_of is not None:
            return self.pid_of(self.collector, worker)
        pids = self.collector.worker_pids()
        return pids[worker] if worker < len(pids) else None

    def _signallable(self) -> list[tuple[int, int]]:
        """``(worker, pid)`` of the active workers whose process runs and was not signalled yet (a
        worker signalled before the collector met its end would be signalled twice)."""
        out = []
        for worker in self.collector.active_workers:
            pid = self._pid(worker)
            if pid is not None and pid not in self._signalled and psutil.pid_exists(pid):
                out.append((worker, pid))
        return out

    def _removable(self) -> list[int]:
        """The active workers, once the collector met the end of every worker signalled so far: a
        worker signalled and removed before that would leave its signal uncounted (the checks count
        one restart cause per signal)."""
        met = len(self.collector.restart_causes) >= len(self._signalled)
        return list(self.collector.active_workers) if met else []

    def possible(self) -> list[str]:
        fewest, most = self.workers
        count = len(self.collector.active_workers)
        allowed = []
        for event in self.events:
            if event in ("kill", "term") and not self._signallable():
                continue
            if event == "add" and count >= most:
                continue
            if event == "remove" and (count <= fewest or not self._removable()):
                continue
            allowed.append(event)
        return allowed

    def step(self) -> str:
        """Draw and run one event; returns its name (``"none"`` when none is possible)."""
        allowed = self.possible()
        if not allowed:
            return "none"
        event = self.rng.choice(allowed)
        if event in ("kill", "term"):
            worker, pid = self.rng.choice(self._signallable())
            self._signalled.add(pid)
            os.kill(pid, signal.SIGKILL if event == "kill" else signal.SIGTERM)
        elif event == "add":
            self.collector.add_collectors([self.make_env])
        else:
            self.collector.remove_collectors([self.rng.choice(self._removable())])
        self.done.append(event)
        if self.after is not None:
            self.after(event)
        return event

    def count(self, event: str) -> int:
        return self.done.count(event)


class FrameCheck:
    """The invariants of collection on CountingEnv batches collected by ``echo_weight_policy``: within
    a trajectory the counter goes up by one from batch to batch (a frame lost, doubled or torn breaks
    it), no step that was not collected, each frame's weight one that was sent."""

    def __init__(self) -> None:
        self.last: dict[int, int] = {}
        self.frames = 0
        self.batches = 0
        #: the weights of the last :data:`RECENT_WEIGHTS` updates (a frame's must be one of them)
        self.weights: dict[float, None] = {}

    def sent(self, weight: float) -> None:
        self.weights[float(weight)] = None
        while len(self.weights) > RECENT_WEIGHTS:
            del self.weights[next(iter(self.weights))]

    def check(self, batch) -> None:
        rows = batch.reshape(-1, batch.shape[-1]) if batch.batch_dims > 1 else batch.unsqueeze(0)
        ids = rows.get(IDS)
        obs = rows["observation"].reshape(ids.shape)
        assert not (ids == -1).any(), "a batch holds steps that were not collected"
        weights = set(torch.unique(rows["policy_weight"]).tolist())
        assert weights <= self.weights.keys(), \
            f"frames collected with weights not among the last {RECENT_WEIGHTS} sent: {weights - self.weights.keys()}"
        done = rows.get(("next", "done")).reshape(ids.shape)[:, -1].tolist()
        for row_ids, row_obs, ended in zip(ids.tolist(), obs.tolist(), done):
            for traj, value in zip(row_ids, row_obs):
                previous = self.last.get(traj)
                assert previous is None or value == previous + 1, \
                    f"trajectory {traj}: {value} follows {previous} (a frame lost, doubled or torn)"
                self.last[traj] = value
            # only the trajectory running at the row's end goes on in a later batch: forget the others
            # (ids are never reused), so that hours of batches do not grow this dict
            for traj in set(row_ids[:-1]) - {row_ids[-1]}:
                self.last.pop(traj, None)
            if ended:
                self.last.pop(row_ids[-1], None)
        self.frames += batch.numel()
        self.batches += 1


def shm_names(pid: int | str = "self") -> set[str]:
    """The ``/dev/shm`` files process ``pid`` maps that still have a name (unlinked ones excluded)."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[5].strip() if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                    names.add(path)
    except (OSError, IndexError):
        pass
    return names


def _shm_mapped() -> tuple[int, int]:
    """Shared-memory files this process maps (named or unlinked: torch's buffers are unlinked at
    once), and the bytes mapped from them."""
    files, size = set(), 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(("/dev/shm/", "/memfd:")):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                files.add(parts[5].strip())
                size += end - start
    return len(files), size


def resources() -> dict[str, int]:
    """This process, now: open descriptors (:func:`open_fds`), shared-memory files mapped and their
    bytes, RSS, threads, live child processes."""
    me = psutil.Process()
    files, mapped = _shm_mapped()
    return {"fds": len(open_fds()), "shm_files": files, "shm_bytes": mapped, "rss": me.memory_info().rss,
            "threads": me.num_threads(), "children": len(children())}


def leftovers(before: dict[int, str], report: "ChurnReport") -> tuple[list[str], dict[int, str]]:
    """Once a collector was shut down and dropped: the named ``/dev/shm`` files its processes mapped
    that still exist, and the descriptors opened since ``before`` (:func:`open_fds`)."""
    import gc

    gc.collect()
    segments = sorted(name for name in report.shm_seen if os.path.exists(name))
    return segments, {fd: target for fd, target in open_fds().items() if before.get(fd) != target}


def process_tree_shm() -> set[str]:
    """The named ``/dev/shm`` files mapped by this process and its descendants, now."""
    names = shm_names()
    for child in psutil.Process().children(recursive=True):
        names |= shm_names(child.pid)
    return names


@dataclass
class ChurnReport:
    """What :func:`drive` saw: the events, and this process's resources at the samples."""

    events: list[str]
    frames: int
    batches: int
    #: ``resources()`` once the first ``warm`` events were met, and after the last one (same workers)
    warm: dict[str, int]
    end: dict[str, int]
    #: named ``/dev/shm`` files the collector's processes mapped at the samples
    shm_seen: set[str]
    #: what the descriptors open at the last sample but not at the first refer to (for messages)
    new_fds: list[str] = field(default_factory=list)


#: batches a sample usually waits for the events so far to be met (what :func:`churn_frames` counts)
SETTLE_BATCHES = 10
#: seconds a sample waits at most for them (a node that joins starts a process)
SETTLE_SECONDS = 60.0


def churn_frames(share: int, events: int, update_every: int = 3, most: int = 3) -> int:
    """A ``total_frames`` that :func:`drive` does not reach before its churn ended: every batch of
    the churn at its largest (``most`` workers of ``share`` frames each)."""
    batches = 1 + events * update_every + 2 * (SETTLE_BATCHES + 2 * most)
    return share * most * batches


class _Drive:
    """What :func:`drive` does between events: take a batch, update the weights, settle and sample."""

    def __init__(self, collector, churn: Churn, check: FrameCheck, policy, workers: int,
                 sample: Callable[[str, dict], None] | None) -> None:
        self.collector, self.churn, self.check, self.policy = collector, churn, check, policy
        self.workers, self.sample = workers, sample
        self.iterator = iter(collector)
        self.weight = 1.0
        check.sent(self.weight)
        self.samples: dict[str, dict] = {}
        self.targets: dict[str, dict[int, str]] = {}
        self.shm_seen: set[str] = set()

    def take(self) -> None:
        try:
            self.check.check(next(self.iterator))
        except StopIteration:
            raise AssertionError("total_frames was reached before the churn ended: give more (churn_frames)") from None

    def update(self) -> None:
        self.weight += 1.0
        with torch.no_grad():
            self.policy.module.weight.fill_(self.weight)
        self.check.sent(self.weight)
        self.collector.update_policy_weights_()

    def settle(self, label: str) -> None:
        """Bring the collector to ``workers`` workers, every signal met, then sample."""
        collector, churn, workers = self.collector, self.churn, self.workers
        while len(collector.active_workers) > workers:
            collector.remove_collectors([collector.active_workers[-1]])
        while len(collector.active_workers) < workers and "add" in churn.events:
            collector.add_collectors([churn.make_env])
        signalled = churn.count("kill") + churn.count("term")
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:  # a preempted worker finishes its rollout first: a batch or two
            self.take()  # (a node that joins takes an empty slot at a batch boundary: seconds, to start)
            if len(collector.restart_causes) >= signalled and len(collector.active_workers) == workers:
                break
        for _ in range(2 * workers):  # every worker delivered a batch (its buffer exists) since it started
            self.take()
        self.samples[label] = resources()
        self.targets[label] = open_fds()
        self.shm_seen.update(process_tree_shm())
        if self.sample is not None:
            self.sample(label, self.samples[label])

    def report(self) -> ChurnReport:
        warm, end = self.targets["warm"], self.targets["end"]
        new_fds = sorted(target for fd, target in end.items() if warm.get(fd) != target)
        return ChurnReport(list(self.churn.done), self.check.frames, self.check.batches, self.samples["warm"],
                           self.samples["end"], self.shm_seen, new_fds)


def drive(collector, churn: Churn, check: FrameCheck, policy, *, events: int, warm: int = 3,
          update_every: int = 3, workers: int = 2, single_at_end: bool = False, to_total: bool = True,
          sample: Callable[[str, dict], None] | None = None) -> ChurnReport:
    """Iterate ``collector`` to its ``total_frames``: a weight update (a new weight of ``policy``, an
    ``echo_weight_policy``) every ``update_every`` batches and one event of ``churn`` beside each,
    before or after it (a worker may die during the update), until ``events`` events ran; every
    batch checked by ``check``.

    Resources are sampled with ``workers`` workers, once every event so far was met (each signalled
    worker replaced): after ``warm`` events, and after the last. Then, with ``single_at_end`` (sync
    collectors, whose batches are the sum of their workers' shares), one worker is left, so that
    ``total_frames`` is met exactly whatever the batches were; ``to_total=False`` stops after the last
    sample instead (an endless collector). ``sample(label, resources)`` is called at every sample.
    """
    run = _Drive(collector, churn, check, policy, workers, sample)
    run.take()
    while len(churn.done) < events:
        for _ in range(update_every - 1):
            run.take()
        event_first = churn.rng.random() < 0.5
        if event_first:
            churn.step()
        run.update()
        if not event_first:
            churn.step()
        run.take()
        if len(churn.done) == warm and "warm" not in run.samples:
            run.settle("warm")
    run.settle("end")
    if single_at_end:
        while len(collector.active_workers) > 1:
            collector.remove_collectors([collector.active_workers[-1]])
    if to_total:
        for batch in run.iterator:
            check.check(batch)
    return run.report()
