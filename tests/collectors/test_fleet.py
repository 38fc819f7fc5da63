"""A collector's workers through its Fleet: one replaced the way a restart will do it (issue: restart
of a failed worker), with the current weights, its seed and fresh trajectory ids."""

from __future__ import annotations

import pytest
import torch
from mocks import weight_policy

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(60)

_IDS = ("collector", "traj_ids")


def envs(n=2):
    return [lambda: CountingEnv(max_steps=4)] * n


def test_a_replaced_worker_runs_the_current_weights_and_version_with_fresh_ids():
    policy = weight_policy(1.0)
    with MultiSyncCollector(envs(), policy, frames_per_batch=8, total_frames=-1, track_policy_version=True) as c:
        before = c.next()
        with torch.no_grad():
            policy.module.weight.fill_(0.0)
        c.update_policy_weights_()
        engine_of(c).fleet.replace(1, policy_version=engine_of(c).weights.version)
        after = c.next()
        assert (after["action"] == 0).all() and (after["policy_version"] == 1).all()
        assert not set(before[_IDS].flatten().tolist()) & set(after[_IDS][1].tolist())
        assert after["observation"][1].flatten().tolist() == [0] * 4  # a fresh env (action 0: it stays)
        assert after[_IDS][0, 0] == before[_IDS][0, -1]  # worker 0 went on with its trajectory


def test_a_replacement_is_seeded_with_its_worker_seed():
    with MultiAsyncCollector(envs(), frames_per_batch=16, total_frames=-1) as c:
        c.set_seed(7)
        assert [spec.seed for spec in engine_of(c).fleet.specs] == [7, engine_of(c).fleet.specs[1].seed] and engine_of(c).fleet.specs[1].seed != 7
        first = c.cascade_execute("workers[1].rollout_batch", True)["action"].flatten().tolist()
        engine_of(c).fleet.replace(1)
        again = c.cascade_execute("workers[1].rollout_batch", True)["action"].flatten().tolist()
        assert again == first and len(set(first)) == 2


# ---------------------------------------------------------------------------------------------- growth
def _grow_fleet(backend_class):
    from rlharvest.collectors import Collector
    from rlharvest.collectors.engine.fleet import Fleet
    from rlharvest.protocol import WorkerSpec
    from rlharvest.worker import run_worker

    fleet = Fleet(backend_class(1, run_worker), {}, timeout=10.0)
    spec = WorkerSpec(0, Collector, lambda: CountingEnv(max_steps=4), {"frames_per_batch": 4})
    fleet.start([spec])
    return fleet, spec


def _collect(fleet, worker: int):
    from rlharvest.protocol import Command

    reply = fleet.requests.wait_for(worker, fleet.requests.send(worker, Command.COLLECT, (False, 0)))
    return fleet.requests.handles[worker].fetch_batch(reply)


def test_a_backend_that_cannot_grow_refuses_before_starting_anything():
    import dataclasses

    from rlharvest.transport.inprocess import InProcessBackend

    class FixedInProcess(InProcessBackend):
        growable = False

    fleet, spec = _grow_fleet(FixedInProcess)
    try:
        with pytest.raises(NotImplementedError, match="cannot add workers"):
            fleet.grow([dataclasses.replace(spec, worker_idx=1)])
        assert len(fleet) == 1 and fleet.backend.num_workers == 1
    finally:
        fleet.stop(5.0)


def test_a_growable_backend_adds_workers_and_undoes_a_failed_growth():
    import dataclasses

    from rlharvest.errors import WorkerError
    from rlharvest.transport.inprocess import InProcessBackend

    fleet, spec = _grow_fleet(InProcessBackend)
    try:
        with pytest.raises(ValueError, match="indices 1..1"):
            fleet.grow([dataclasses.replace(spec, worker_idx=2)])
        fleet.grow([dataclasses.replace(spec, worker_idx=1)])
        assert len(fleet) == len(fleet.requests) == fleet.backend.num_workers == 2
        assert _collect(fleet, 1).numel() == 4  # the new worker collects

        def broken():
            raise ValueError("this env cannot be built")

        with pytest.raises(WorkerError, match="cannot be built"):
            fleet.grow([dataclasses.replace(spec, worker_idx=2, create_env_fn=broken)])
        assert len(fleet) == len(fleet.requests) == fleet.backend.num_workers == 2  # as it was
        assert _collect(fleet, 0).numel() == 4 and fleet.requests.handles[1].is_alive()  # the others go on
    finally:
        fleet.stop(5.0)


def test_a_weight_scheme_that_cannot_serve_new_workers_refuses_the_growth():
    import dataclasses
    import types

    from rlharvest.transport.inprocess import InProcessBackend

    class GrowableInProcess(InProcessBackend):
        growable = True

    class FixedScheme:  # a sender sized once (shared-memory buffers per worker)
        sender_transports = types.SimpleNamespace(growable=False)

        def connect(self) -> None:
            pass

    fleet, spec = _grow_fleet(GrowableInProcess)
    fleet.schemes = {"policy": FixedScheme()}
    try:
        with pytest.raises(NotImplementedError, match="'policy'.*FixedScheme"):
            fleet.grow([dataclasses.replace(spec, worker_idx=1)])
        assert len(fleet) == fleet.backend.num_workers == 1
    finally:
        fleet.stop(5.0)


# ---------------------------------------------------------------------------------------------- replacements
@pytest.mark.parametrize("max_restarts", [0, 2])
def test_the_backend_is_told_before_start_whether_failed_workers_will_be_replaced(max_restarts):
    from rlharvest.collectors import Collector
    from rlharvest.collectors.engine.fleet import Fleet
    from rlharvest.collectors.engine.restarts import RestartPolicy
    from rlharvest.protocol import WorkerSpec
    from rlharvest.transport.inprocess import InProcessBackend
    from rlharvest.worker import run_worker

    class Recording(InProcessBackend):
        def start_all(self, specs):
            self.expected_at_start = self.replacements_expected
            return super().start_all(specs)

    backend = Recording(1, run_worker)
    fleet = Fleet(backend, {}, timeout=10.0, restarts=RestartPolicy(max_restarts))
    fleet.start([WorkerSpec(0, Collector, lambda: CountingEnv(max_steps=4), {"frames_per_batch": 4})])
    try:
        assert backend.expected_at_start is (max_restarts > 0)
    finally:
        fleet.stop(5.0)


def _no_env():
    raise RuntimeError("no env for worker 1")


def test_workers_started_without_waiting_queue_commands_and_raise_their_failure_to_build():
    from rlharvest import WorkerError
    from rlharvest.collectors import Collector
    from rlharvest.collectors.engine.fleet import Fleet
    from rlharvest.protocol import Command, WorkerSpec
    from rlharvest.transport.inprocess import InProcessBackend
    from rlharvest.worker import run_worker

    fleet = Fleet(InProcessBackend(2, run_worker), {}, timeout=10.0)
    specs = [WorkerSpec(0, Collector, lambda: CountingEnv(max_steps=4), {"frames_per_batch": 4}),
             WorkerSpec(1, Collector, _no_env, {"frames_per_batch": 4})]
    fleet.start(specs, wait=False)  # does not raise: worker 1's failure comes with the first wait on it
    try:
        reply = fleet.requests.wait_for(0, fleet.requests.send(0, Command.COLLECT, (False, 0)))
        assert reply.frames == 4 and fleet.requests.handles[0].fetch_batch(reply).numel() == 4
        with pytest.raises(WorkerError, match="no env for worker 1") as info:
            fleet.requests.request(1, Command.COLLECT, (False, 0))
        assert info.value.worker_idx == 1 and isinstance(info.value, RuntimeError)  # the cause, not the exit
        assert fleet.requests.is_dead(1)
    finally:
        fleet.stop(5.0)
