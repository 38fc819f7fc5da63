"""The autoscaler's controller (docs/elastic.md, "Autoscaling") on simulated fleets: no process, no
clock. A simulated fleet produces the measurements a collector would (how long the learner waited for
each batch, how long it worked, how long workers held finished batches), so the rules are checked on
the dynamics they are meant for: growth while the learner starves, shrinking while workers idle, the
bounds, no flapping on noisy timings."""

from __future__ import annotations

import logging
import random

import pytest

from rlharvest.collectors import Autoscale
from rlharvest.collectors.engine.autoscale import Autoscaler
from rlharvest.collectors.options.autoscale import parse_autoscale
from rlharvest.errors import WorkerError


class SimulatedFleet:
    """Workers whose rollouts take ``rollout_s`` seconds and a learner that works ``work_s`` per batch,
    on a virtual clock; each timing is multiplied by a uniform factor in ``1 ± noise``.

    Asynchronous: each worker holds at most one finished batch and starts its next rollout once its
    batch is taken (the first finished is served). Synchronous: every batch asks one rollout of
    ``rollout_s / n`` of each of the ``n`` workers (a batch keeps its size) and the learner waits for
    the slowest, plus ``overhead_s`` per worker (what a batch costs besides its rollouts); the others
    hold theirs meanwhile. Implements ``ScalingTarget``.
    """

    def __init__(self, workers: int, rollout_s: float, work_s: float, *, sync: bool = False,
                 noise: float = 0.0, seed: int = 0, overhead_s: float = 0.0) -> None:
        self.rollout_s, self.work_s, self.sync, self.noise = rollout_s, work_s, sync, noise
        self.overhead_s = overhead_s
        self.rng = random.Random(seed)
        self.now = 0.0
        self.done_at: dict[int, float] = {}  # async: worker -> when its rollout in flight finishes
        self.next_index = 0
        self.added: list[int] = []
        self.removed: list[int] = []
        self._start(workers)

    def _jitter(self, seconds: float) -> float:
        return seconds * self.rng.uniform(1 - self.noise, 1 + self.noise)

    def _start(self, count: int) -> list[int]:
        new = list(range(self.next_index, self.next_index + count))
        self.next_index += count
        for worker in new:
            self.done_at[worker] = self.now + self._jitter(self.rollout_s)
        return new

    # ScalingTarget
    def active_workers(self) -> list[int]:
        return sorted(self.done_at)

    def add_workers(self, count: int) -> list[int]:
        new = self._start(count)
        self.added += new
        return new

    def remove_workers(self, indices: list[int]) -> None:
        for worker in indices:
            del self.done_at[worker]
        self.removed += indices

    def batch(self) -> tuple[float, float, float]:
        """The learner works, then asks for a batch: ``(wait_s, work_s, idle_s)`` of that batch."""
        work = self._jitter(self.work_s)
        self.now += work
        if self.sync:
            share = self.rollout_s / len(self.done_at)
            rollouts = [self._jitter(share) for _ in self.done_at]
            wait = max(rollouts) + self.overhead_s * len(rollouts)
            self.now += wait
            return wait, work, sum(wait - r for r in rollouts)
        worker = min(self.done_at, key=self.done_at.get)
        finished = self.done_at[worker]
        wait = max(0.0, finished - self.now)
        self.now += wait
        self.done_at[worker] = self.now + self._jitter(self.rollout_s)
        # each worker's holding time is reported when its batch is taken
        return wait, work, max(0.0, self.now - finished)  # (float rounding when it waited)


def run(fleet: SimulatedFleet, autoscaler: Autoscaler, batches: int) -> list[int]:
    """Collect ``batches`` batches under ``autoscaler``; the worker count after each."""
    counts = []
    for _ in range(batches):
        autoscaler.record(*fleet.batch())
        autoscaler.decide()
        counts.append(len(fleet.active_workers()))
    return counts


def reversals(counts: list[int]) -> int:
    """How often the count changed direction (an add after a remove, or a remove after an add)."""
    steps = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))


def scaler(fleet: SimulatedFleet, *args, **kwargs) -> Autoscaler:
    return Autoscaler(Autoscale(*args, **kwargs), fleet, sync=fleet.sync, clock=lambda: fleet.now)


# ---------------------------------------------------------------------------------------- growth
def test_a_starving_learner_grows_the_fleet_to_the_pace_it_needs():
    # rollouts of 1 s, a learner working 0.25 s per batch: 4 workers keep it fed
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=0.25)
    autoscaler = scaler(fleet, 1, 10)
    counts = run(fleet, autoscaler, 200)
    assert counts[-1] in (4, 5)
    assert fleet.removed == [] and fleet.added == list(range(1, counts[-1]))  # only upwards
    assert [d.wanted for d in autoscaler.decisions][:2] == [2, 4]  # at most doubling, by the demand
    assert all(d.reason == "learner_wait" and d.learner_wait > 0.10 for d in autoscaler.decisions)
    assert autoscaler.signals()[0] <= 0.10


def test_growth_stops_at_max_collectors():
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=0.01)  # would need 100 workers
    counts = run(fleet, scaler(fleet, 1, 3), 200)
    assert max(counts) == 3 and counts[-1] == 3


def test_the_first_batch_and_the_cooldown_are_waited_for():
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=0.01)
    counts = run(fleet, scaler(fleet, 1, 8, cooldown=5), 14)
    # batch 1 is not used (workers starting), batches 2-6 fill the cool-down; after the add, 2 batches
    # are not used (the new worker's first rollout), then 5 fill the cool-down. The demand asks for 90
    # workers: the fleet doubles at most.
    assert counts == [1] * 5 + [2] * 7 + [4] * 2


# ---------------------------------------------------------------------------------------- shrinking
def test_idle_workers_are_removed_down_to_what_the_learner_takes():
    # rollouts of 1 s, a learner working 0.5 s per batch: 2 workers keep it fed, 6 idle
    fleet = SimulatedFleet(6, rollout_s=1.0, work_s=0.5)
    autoscaler = scaler(fleet, 1, 8)
    counts = run(fleet, autoscaler, 300)
    assert counts[-1] == 3  # busy two thirds of the time: 2 would leave no spare
    assert fleet.added == [] and fleet.removed == [3, 4, 5]  # the newest, at once, after a window
    assert [(d.batch, d.reason) for d in autoscaler.decisions] == [(17, "worker_idle")]


def test_a_removal_that_would_starve_the_learner_is_not_taken():
    # 2 workers, each busy 75% of the time: one alone could not keep up, however idle the two look
    fleet = SimulatedFleet(2, rollout_s=1.5, work_s=1.0)
    autoscaler = scaler(fleet, 1, 4, shrink_above=0.0)
    assert run(fleet, autoscaler, 200) == [2] * 200
    assert autoscaler.signals()[1] > 0.2  # idle, yet kept


def test_shrinking_stops_at_min_collectors():
    fleet = SimulatedFleet(4, rollout_s=0.1, work_s=1.0)
    counts = run(fleet, scaler(fleet, 2, 4), 200)
    assert min(counts) == 2 and counts[-1] == 2


def best_fixed(rollout_s: float, work_s: float, noise: float, sync: bool = False) -> int:
    """The fewest workers that keep the learner's wait at or below ``grow_above`` (0.10) without
    autoscaling: what a sweep of fixed counts finds."""
    for workers in range(1, 9):
        fleet = SimulatedFleet(workers, rollout_s, work_s, sync=sync, noise=noise, seed=99)
        timings = [fleet.batch() for _ in range(600)][100:]
        if sum(t[0] for t in timings) / sum(t[0] + t[1] for t in timings) <= 0.10:
            return workers
    return 8


def test_the_fleet_follows_a_change_of_pace_both_ways():
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=0.2, noise=0.2)
    autoscaler = scaler(fleet, 1, 8)
    fast = run(fleet, autoscaler, 250)
    fleet.work_s = 1.0  # the learner slows down
    slow = run(fleet, autoscaler, 250)
    fleet.work_s = 0.2
    fast_again = run(fleet, autoscaler, 250)
    best_fast, best_slow = best_fixed(1.0, 0.2, 0.2), best_fixed(1.0, 1.0, 0.2)
    assert (best_fast, best_slow) == (5, 1)
    # one more than the sweep's best: a removal must leave the others a fifth of their time spare
    assert fast[-1] == fast_again[-1] == best_fast + 1 and slow[-1] == best_slow + 1
    assert reversals(fast) == reversals(slow) == reversals(fast_again) == 0


# ---------------------------------------------------------------------------------------- synchronous
def test_sync_grows_while_the_learner_waits_and_shrinks_when_it_slows():
    # a batch is 1 s of rollouts split among the workers; the learner waits for all of them
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=2.0, sync=True, noise=0.1)
    autoscaler = scaler(fleet, 1, 8)
    starving = run(fleet, autoscaler, 200)  # 1 worker: waits 1 of every 3 s
    assert starving[-1] >= 4 and fleet.removed == []  # 0.25 / 2.25 s: about 0.1 of its time
    assert autoscaler.signals()[0] < 0.15
    fleet.work_s = 20.0  # the learner slows down: 1 worker makes it wait 5%
    slow = run(fleet, autoscaler, 300)
    assert slow[-1] in (1, 2)
    assert {d.reason for d in autoscaler.decisions if d.action == "remove"} == {"learner_wait"}


def test_sync_undoes_an_add_that_did_not_shorten_the_wait():
    # a batch of 0.1 s of rollouts plus 0.01 s per worker that does not split: the wait per batch is
    # 0.1 / n + 0.01 n (0.11, 0.07, 0.063, 0.065 with 1-4 workers), never 10% of 0.2 s of work
    fleet = SimulatedFleet(1, rollout_s=0.1, work_s=0.2, sync=True, overhead_s=0.01)
    autoscaler = scaler(fleet, 1, 8)
    counts = run(fleet, autoscaler, 300)
    assert [(d.action, d.reason, d.wanted) for d in autoscaler.decisions] == \
        [("add", "learner_wait", 2), ("add", "learner_wait", 4), ("remove", "no_gain", 2)]
    assert counts[-1] == 2 and fleet.removed == [2, 3]
    fleet.rollout_s = 1.0  # longer rollouts: more workers help again (0.51 s per batch with 2)
    counts = run(fleet, autoscaler, 300)
    assert counts[-1] > 2 and autoscaler.decisions[3].action == "add"


def test_sync_never_removes_a_worker_the_learner_would_wait_for():
    # 3 workers: the learner waits 0.33 of 10.33 s (3%); with 2 it would wait 0.5 of 10.5 (4.8%)
    fleet = SimulatedFleet(3, rollout_s=1.0, work_s=10.0, sync=True)
    assert run(fleet, scaler(fleet, 1, 4, shrink_below=0.045), 200) == [3] * 200


# ---------------------------------------------------------------------------------------- no flapping
@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_noisy_timings_do_not_make_the_count_flap(sync, seed):
    # timings jitter by +-50% around a pace that 3 workers meet (async) / a steady state (sync)
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=0.4 if not sync else 3.0, sync=sync, noise=0.5, seed=seed)
    autoscaler = scaler(fleet, 1, 8)
    counts = run(fleet, autoscaler, 1500)
    # after an add of several workers the fleet may try one fewer, once: a probe, not a flap
    assert reversals(counts) <= 2, counts[::25]
    assert len(autoscaler.decisions) <= 8 and counts[-1] >= 3


def test_the_fleet_shrinks_back_to_where_the_learner_starved_only_once_the_pace_halved():
    fleet = SimulatedFleet(3, rollout_s=1.0, work_s=1.0)  # a target only: the measurements are made up
    autoscaler = scaler(fleet, 1, 8, cooldown=4, window=8)
    for _ in range(5):  # 3 workers busy all the time, the learner waits 13% of its time: demand 3.45
        autoscaler.record(wait_s=0.15, work_s=1.0, idle_s=0.0)
    assert autoscaler.decide().action == "add"
    # 4 workers idle half the time: 3 would still idle 33% (> shrink_above), but the demand (2 busy
    # workers per second of learner work) is more than half the one that starved the learner
    for _ in range(40):
        autoscaler.record(wait_s=0.0, work_s=1.0, idle_s=2.0)
        assert autoscaler.decide() is None
    for _ in range(8):  # the demand halved: 1.6 workers busy
        autoscaler.record(wait_s=0.0, work_s=1.0, idle_s=2.4)
    decision = autoscaler.decide()
    assert (decision.action, decision.reason, decision.workers) == ("remove", "worker_idle", (3,))


def test_a_threshold_band_keeps_the_count_when_signals_sit_between_them():
    # the learner waits about 7% of its time: above shrink_below, below grow_above
    fleet = SimulatedFleet(2, rollout_s=1.0, work_s=6.5, sync=True)
    autoscaler = scaler(fleet, 1, 4)
    assert run(fleet, autoscaler, 200) == [2] * 200
    assert 0.05 < autoscaler.signals()[0] < 0.10 and autoscaler.decisions == []


# ---------------------------------------------------------------------------------------- bounds
def test_a_count_outside_the_bounds_is_brought_back_at_the_first_decision():
    below = SimulatedFleet(1, rollout_s=1.0, work_s=10.0)
    autoscaler = scaler(below, 3, 5)
    assert autoscaler.decide().action == "add" and below.active_workers() == [0, 1, 2]
    above = SimulatedFleet(6, rollout_s=0.1, work_s=0.0)
    autoscaler = scaler(above, 1, 4)
    decision = autoscaler.decide()
    assert (decision.action, decision.reason, decision.workers) == ("remove", "max_collectors", (4, 5))


def test_a_worker_that_leaves_by_itself_restarts_the_measurements():
    fleet = SimulatedFleet(3, rollout_s=1.0, work_s=0.1)
    autoscaler = scaler(fleet, 1, 8, cooldown=4)
    for _ in range(4):
        autoscaler.record(*fleet.batch())
    fleet.remove_workers([0])  # preempted, not replaced
    autoscaler.record(*fleet.batch())
    assert autoscaler.decide() is None  # 1 batch measured on 2 workers: cooling down
    for _ in range(3):
        autoscaler.record(*fleet.batch())
    assert autoscaler.decide().collectors == 2


@pytest.mark.parametrize("kwargs, named", [
    ({"min_collectors": 0, "max_collectors": 2}, "min_collectors"),
    ({"min_collectors": 1.0, "max_collectors": 2}, "min_collectors"),
    ({"min_collectors": 3, "max_collectors": 2}, "max_collectors"),
    ({"min_collectors": 1, "max_collectors": True}, "max_collectors"),
    ({"min_collectors": 1, "max_collectors": 2, "window": 0}, "window"),
    ({"min_collectors": 1, "max_collectors": 2, "cooldown": 0}, "cooldown"),
    ({"min_collectors": 1, "max_collectors": 2, "grow_above": 0.0}, "grow_above"),
    ({"min_collectors": 1, "max_collectors": 2, "grow_above": 1.0}, "grow_above"),
    ({"min_collectors": 1, "max_collectors": 2, "shrink_above": -0.1}, "shrink_above"),
    ({"min_collectors": 1, "max_collectors": 2, "shrink_below": 0.2}, "shrink_below"),
    ({"min_collectors": 1, "max_collectors": 2, "join_timeout": float("inf")}, "join_timeout"),
    ({"min_collectors": 1, "max_collectors": 2, "env_fn": "CartPole-v1"}, "env_fn"),
    ({"min_collectors": 1, "max_collectors": 2, "on_scale": 3}, "on_scale"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named) as info:
        Autoscale(**kwargs)
    assert repr(kwargs[named]) in str(info.value)


@pytest.mark.parametrize("arguments, named", [
    ({"launcher": "submitit_delayed"}, "launcher='submitit_delayed'"),
    ({"launcher": "mp", "backend": "mpi"}, "backend='mpi'"),
    ({"launcher": "external", "joins": True}, "on_scale"),
    ({"launcher": "external"}, "launcher='external'"),  # RPCCollector: its nodes do not join
    ({"sync": True, "typed_workers": False}, "collector_class"),
    ({"legacy_updater": True}, "weight_updater"),
    ({"distinct_factories": True}, "policy_factory"),
])
def test_collectors_that_cannot_change_their_workers_are_refused(arguments, named):
    arguments = {"sync": False, "typed_workers": True, **arguments}
    with pytest.raises(ValueError, match=named):
        parse_autoscale(Autoscale(1, 4), **arguments)


def test_on_scale_is_for_nodes_that_join_only():
    with pytest.raises(ValueError, match="launcher='external' only"):
        parse_autoscale(Autoscale(1, 4, on_scale=print), sync=False, typed_workers=True, launcher="mp")
    with pytest.raises(TypeError, match="Autoscale"):
        parse_autoscale((1, 4), sync=False, typed_workers=True)


def test_elastic_launchers_are_accepted():
    for launcher in ("mp", "submitit", None):
        parse_autoscale(Autoscale(1, 4), sync=True, typed_workers=True, launcher=launcher, backend="gloo")
    parse_autoscale(Autoscale(1, 4, on_scale=print), sync=False, typed_workers=True, launcher="external",
                    backend="nccl", joins=True)
    assert parse_autoscale(None, sync=True, typed_workers=False, legacy_updater=True) is None


@pytest.mark.parametrize("name", ["wait_s", "work_s", "idle_s"])
@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_bad_measurements_are_refused_naming_them(name, value):
    autoscaler = scaler(SimulatedFleet(1, 1.0, 1.0), 1, 2)
    measurements = {"wait_s": 0.1, "work_s": 0.1, "idle_s": 0.0, name: value}
    with pytest.raises(ValueError, match=name):
        autoscaler.record(**measurements)


# ---------------------------------------------------------------------------------------- visible decisions
def test_every_decision_is_in_stats_and_in_the_log(caplog):
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=0.3)
    autoscaler = scaler(fleet, 1, 8)
    with caplog.at_level(logging.INFO, logger="rlharvest"):
        run(fleet, autoscaler, 100)
    stats = autoscaler.stats()
    decisions = stats["autoscale/decisions"]
    assert stats["autoscale/collectors"] == len(fleet.active_workers()) == 1 + sum(len(d["workers"]) for d in decisions)
    assert stats["autoscale/adds"] == len(decisions) and stats["autoscale/removes"] == 0
    assert all(isinstance(stats[f"autoscale/{key}"], float) for key in ("learner_wait", "worker_idle"))
    first = decisions[0]
    assert (first["action"], first["reason"], first["collectors"], first["wanted"], first["workers"]) == \
        ("add", "learner_wait", 1, 2, (1,))
    assert first["learner_wait"] > 0.10 and first["batch"] == 9 and first["elapsed_s"] > 0
    assert [d["elapsed_s"] for d in decisions] == sorted(d["elapsed_s"] for d in decisions)
    records = [r for r in caplog.records if r.name == "rlharvest.autoscale"]
    assert len(records) == len(decisions) and all(r.levelno == logging.INFO for r in records)
    assert "add workers [1], 1 -> 2 collecting (learner_wait; learner waited" in records[0].getMessage()


class FailingFleet(SimulatedFleet):
    def add_workers(self, count: int) -> list[int]:
        raise WorkerError("this env cannot be built", worker_idx=self.next_index)


def test_a_failed_add_is_recorded_logged_and_retried_later(caplog):
    fleet = FailingFleet(1, rollout_s=1.0, work_s=0.01)
    autoscaler = scaler(fleet, 1, 4, cooldown=4)
    with caplog.at_level(logging.INFO, logger="rlharvest"):
        run(fleet, autoscaler, 1 + 4 + 8 + 16)
    assert fleet.active_workers() == [0]
    assert [d.batch for d in autoscaler.decisions] == [5, 13, 29]  # the cool-down doubles: 4, 8, 16
    assert all(d.error == "WorkerError: worker 1: this env cannot be built" for d in autoscaler.decisions)
    warnings = [r for r in caplog.records if r.name == "rlharvest.autoscale"]
    assert len(warnings) == 3 and all(r.levelno == logging.WARNING for r in warnings)


# ---------------------------------------------------------------------------------------- launcher="external"
def test_external_nodes_are_asked_of_on_scale_and_waited_for():
    calls = []
    fleet = SimulatedFleet(1, rollout_s=1.0, work_s=0.01)
    config = Autoscale(1, 4, cooldown=2, join_timeout=30.0, on_scale=lambda *args: calls.append(args))
    join = ["python", "-m", "rlharvest", "node", "--join", "10.0.0.5:29500", "--key-file", "/tmp/k"]
    autoscaler = Autoscaler(config, fleet, sync=False, join_command=join, clock=lambda: fleet.now)
    run(fleet, autoscaler, 3)
    assert calls == [(2, join)] and fleet.added == []
    assert autoscaler.decisions[-1].workers == () and autoscaler.decisions[-1].wanted == 2
    run(fleet, autoscaler, 20)  # starving, but the node asked for has not joined: nothing asked
    assert len(calls) == 1
    fleet.add_workers(1)  # it joins
    run(fleet, autoscaler, 4)  # 2 batches not used (its first rollout), 2 of cool-down
    assert calls[-1] == (4, join)  # still starving: twice as many
    fleet.now += 31.0  # they never join: asked again after join_timeout
    run(fleet, autoscaler, 3)
    assert calls[-1] == (4, join) and len(calls) == 3


def test_external_nodes_are_removed_by_the_collector():
    fleet = SimulatedFleet(3, rollout_s=0.1, work_s=1.0)
    config = Autoscale(1, 4, on_scale=lambda *args: pytest.fail("no node is wanted"))
    autoscaler = Autoscaler(config, fleet, sync=False, join_command=["node"], clock=lambda: fleet.now)
    run(fleet, autoscaler, 100)
    assert fleet.removed == [1, 2]


def test_external_without_on_scale_is_refused():
    with pytest.raises(ValueError, match="on_scale"):
        Autoscaler(Autoscale(1, 2), SimulatedFleet(1, 1.0, 1.0), sync=False, join_command=["node"])
