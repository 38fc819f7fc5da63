"""The backend contract: the same tests against every backend.

A backend is correct when these pass: it starts workers from their specs, carries commands, replies
and batches, carries failures back, delivers weights and their acknowledgements, replaces one
worker (same index, the current weights and version, fresh trajectory ids, the others untouched)
and stops everything within one deadline. The tests drive a backend the way every collector does,
through a :class:`~rlharvest.collectors.engine.fleet.Fleet` (backend + worker pool + weight scheme).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from mocks import FaultyEnv, weight_policy

from rlharvest import WorkerError
from rlharvest.collectors import Collector
from rlharvest.collectors.engine.fleet import Fleet
from rlharvest.collectors.options.local import LocalOptions
from rlharvest.config import CollectorConfig
from rlharvest.collectors.options.common import stateless_copy
from rlharvest.envs import CountingEnv
from rlharvest.protocol import Command, WorkerSpec
from rlharvest.collectors.options.network import NetworkConfig
from rlharvest.transport.inprocess import InProcessBackend
from rlharvest.transport.mp import MPBackend, mp_context
from rlharvest.transport.ray import RayBackend
from rlharvest.transport.rpc import RPCBackend
from rlharvest.transport.torchdist import TorchDistBackend
from rlharvest.weight_update.schemes import WeightSyncScheme
from rlharvest.weight_update.strategy import weights_of
from rlharvest.worker import run_worker
from rlharvest.worker.nodes import RPC_CALLS, node_main

pytestmark = pytest.mark.timeout(60)

FRAMES = 4  # per rollout; CountingEnv(max_steps=2) with action 1 ends a trajectory every 3 steps


class Learner:
    """The sender side's context: the learner's policy, and the backend's links (a SenderContext)."""

    def __init__(self, policy, backend) -> None:
        self.policy = policy
        self.backend = backend

    def get_model(self, model_id: str):
        return self.policy

    def weight_links(self):
        return self.backend.weight_links()


@dataclass
class Setup:
    """How a backend's collectors use it (what the tests would otherwise repeat per backend)."""

    make_backend: object
    #: workers share one trajectory counter (else each starts at 0 and the spec's offset keeps ids apart)
    shared_ids: bool
    #: workers get a stateless policy and their weights from the scheme (else the policy itself)
    stateless: bool = True
    #: what the backend needs of a worker added later (``Backend.grow``)
    grow_options: list | None = None


def network(port: int, key: bool = True) -> NetworkConfig:
    """Local nodes ("mp" launcher) on loopback, with the timeouts of a test."""
    return NetworkConfig.parse(launcher="mp", tcp_port=port, bind_address=None, authkey=None, worker_timeout=30.0,
                               heartbeat_timeout=10.0, needs_key=key)


SETUPS = {
    "inprocess": Setup(lambda count, port: InProcessBackend(count, run_worker), shared_ids=True),
    "mp": Setup(lambda count, port: MPBackend(count, run_worker, mp_context()), shared_ids=True),
    "torchdist": Setup(lambda count, port: TorchDistBackend(count, node_main, network(port), launcher="mp"),
                       shared_ids=False),
    "rpc": Setup(lambda count, port: RPCBackend(count, node_main, RPC_CALLS, network(port, key=False), launcher="mp"),
                 shared_ids=False, stateless=False),
    # half a CPU per actor: three fit the test session's two CPUs
    "ray": Setup(lambda count, port: RayBackend(count, run_worker, [{"num_cpus": 0.5}] * count), shared_ids=False,
                 grow_options=[{"num_cpus": 0.5}]),
}
#: backends that need a service of the session (the ``ray`` marker selects, or deselects, them)
MARKS = {"ray": [pytest.mark.ray]}


class Harness:
    """A fleet of ``count`` workers on one backend, with a weight scheme from the learner's policy."""

    def __init__(self, name: str, count: int, env_fn, port: int, frames: int = FRAMES) -> None:
        self.setup = SETUPS[name]
        self.backend = self.setup.make_backend(count, port)
        self.policy = weight_policy(1.0)
        self.scheme = WeightSyncScheme.from_backend(self.backend.default_scheme())
        self.learner = Learner(self.policy, self.backend)  # schemes hold their context weakly
        self.scheme.init_on_sender(model_id="policy", context=self.learner)
        try:
            self._start(count, env_fn, frames)
        except BaseException:
            self.scheme.shutdown()
            raise

    def _start(self, count: int, env_fn, frames: int) -> None:
        counter = self.backend.trajectory_counter() if self.setup.shared_ids else None
        options = LocalOptions(config=CollectorConfig(frames_per_batch=frames, track_policy_version=True),
                               create_env_fn=None, trajectory_counter=counter)
        policy = stateless_copy(self.policy) if self.setup.stateless else self.policy
        self._spec_of = lambda w, env, version=0: WorkerSpec(w, Collector, env, options=options, policy=policy,
                                                              weight_recv_schemes={"policy": self.scheme},
                                                              policy_version=version)
        specs = [self._spec_of(w, env_fn(w)) for w in range(count)]
        self.fleet = Fleet(self.backend, {"policy": self.scheme}, timeout=30.0)
        self.backend.expect_replacements()  # the contract includes replacing workers
        self.fleet.start(specs)
        self.requests = self.fleet.requests
        self.count = count
        self.seen_ids: dict[int, set[int]] = {w: set() for w in range(count)}
        self.local_max = [-1] * count

    def collect(self, worker: int) -> dict:
        """One rollout of ``worker``, as plain lists (the worker reuses its batch buffer); ids are made
        unique across workers as collectors make them (nodes count on their own: ``k * W + i``)."""
        reply = self.requests.wait_for(worker, self.requests.send(worker, Command.COLLECT, (False, 0)))
        batch = self.requests.handles[worker].fetch_batch(reply)
        out = {key: batch.get(key).reshape(-1).tolist()
               for key in ("observation", "action", "policy_version", ("collector", "traj_ids"))}
        ids = out[("collector", "traj_ids")]
        if not self.setup.shared_ids:
            self.local_max[worker] = max(self.local_max[worker], *ids)
            ids = out[("collector", "traj_ids")] = [k * self.count + worker for k in ids]
        self.seen_ids[worker].update(ids)
        return out

    def set_weight(self, value: float) -> None:
        with torch.no_grad():
            self.policy.module.weight.fill_(value)
        self.scheme.send()

    def replace(self, worker: int) -> None:
        changes = {"policy_version": self.scheme.version}
        if not self.setup.shared_ids:  # past every id the worker it replaces handed out
            changes["traj_offset"] = self.local_max[worker] + 1
        self.fleet.replace(worker, **changes)

    def grow(self, env_fn) -> int:
        """Add a worker after the others (its index), on the current weights and version."""
        worker = len(self.fleet)
        self.fleet.grow([self._spec_of(worker, env_fn, self.scheme.version)], self.setup.grow_options)
        self.seen_ids[worker] = set()
        self.local_max.append(-1)
        return worker

    def close(self) -> None:
        self.fleet.stop(10.0)
        self.scheme.shutdown()


@pytest.fixture(params=[pytest.param(name, marks=MARKS.get(name, [])) for name in SETUPS])
def harness(request, free_port):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    made = []

    def make(count: int = 2, env_fn=lambda w: (lambda: CountingEnv(max_steps=2)), **kwargs) -> Harness:
        made.append(Harness(request.param, count, env_fn, free_port, **kwargs))
        return made[-1]

    yield make
    for item in made:
        item.close()


def test_start_collect_stop(harness):
    fleet = harness(count=2)
    first, second = fleet.collect(0), fleet.collect(1)
    for out in (first, second):
        assert out["observation"] == [0, 1, 2, 0]  # auto-reset once the counter passed 2
        assert out["action"] == [1.0] * FRAMES and out["policy_version"] == [0] * FRAMES
    ids = first[("collector", "traj_ids")] + second[("collector", "traj_ids")]
    assert len(set(ids)) == 4  # two trajectories per worker, none shared
    assert fleet.collect(0)["observation"] == [1, 2, 0, 1]  # the env goes on where it was
    handles = list(fleet.requests.handles)
    fleet.fleet.stop(10.0)
    assert not any(handle.is_alive() for handle in handles)
    fleet.fleet.stop(10.0)  # idempotent


def test_weights_delivered_and_acknowledged(harness):
    fleet = harness(count=2)
    fleet.collect(0)
    fleet.set_weight(0.0)  # sync scheme: returns once both workers acknowledged version 1
    assert fleet.scheme.version == 1
    for worker in (0, 1):
        out = fleet.collect(worker)
        assert out["action"] == [0.0] * FRAMES and out["policy_version"] == [1] * FRAMES
    fleet.scheme.send(weights=weights_of(weight_policy(1.0)), worker_ids=[1])
    assert fleet.collect(1)["action"] == [1.0] * FRAMES
    assert fleet.collect(0)["action"] == [0.0] * FRAMES  # not targeted


def test_replace_one_worker(harness):
    fleet = harness(count=2)
    before = fleet.collect(0)
    fleet.collect(1)
    fleet.set_weight(0.0)
    fleet.set_weight(1.0)
    old_handle = fleet.requests.handles[1]
    fleet.replace(1)
    assert fleet.requests.handles[1] is not old_handle and not old_handle.is_alive()
    used = set().union(*fleet.seen_ids.values())
    fresh = fleet.collect(1)
    assert fresh["action"] == [1.0] * FRAMES  # the current weights, before its first step
    assert fresh["policy_version"] == [2] * FRAMES  # and the current version
    assert fresh["observation"] == [0, 1, 2, 0]  # a fresh env
    assert not used & set(fresh[("collector", "traj_ids")])  # fresh trajectory ids
    survivor = fleet.collect(0)  # the other worker kept its env and trajectories: it goes on
    assert survivor["observation"] == [1, 2, 0, 1] and survivor["policy_version"] == [2] * FRAMES
    assert survivor[("collector", "traj_ids")][0] == before[("collector", "traj_ids")][-1]
    fleet.set_weight(0.0)  # the replacement acknowledges updates like the others
    assert fleet.collect(1)["action"] == [0.0] * FRAMES and fleet.collect(0)["action"] == [0.0] * FRAMES


def test_replace_a_dead_worker(harness):
    fleet = harness(count=2)
    fleet.collect(1)
    fleet.backend.stop_one(1, time.monotonic())  # the worker is gone, as after a crash
    with pytest.raises(WorkerError) as info:
        fleet.collect(1)
    assert info.value.worker_idx == 1
    fleet.replace(1)
    assert fleet.collect(1)["observation"] == [0, 1, 2, 0]


def test_add_one_worker(harness):
    fleet = harness(count=2)
    fleet.collect(0)
    fleet.collect(1)
    fleet.set_weight(0.0)
    used = set().union(*fleet.seen_ids.values())
    added = fleet.grow(lambda: CountingEnv(max_steps=2))
    assert added == 2 and fleet.fleet.active == [0, 1, 2]
    fresh = fleet.collect(added)
    assert fresh["action"] == [0.0] * FRAMES and fresh["policy_version"] == [1] * FRAMES  # current weights
    assert fresh["observation"] == [0] * FRAMES  # a fresh env, never stepped up by the former weights
    if fleet.setup.shared_ids:  # (nodes count their own ids: collectors give an added node a fresh segment)
        assert not used & set(fresh[("collector", "traj_ids")])
    fleet.set_weight(1.0)  # the added worker acknowledges updates like the others
    assert all(fleet.collect(worker)["action"] == [1.0] * FRAMES for worker in (0, 1, 2))


def test_remove_one_worker(harness):
    fleet = harness(count=3)
    fleet.collect(1)
    leaving = fleet.requests.handles[1]
    fleet.fleet.remove([1], timeout=20.0)
    assert not leaving.is_alive() and fleet.fleet.active == [0, 2]
    fleet.set_weight(0.0)  # an update goes to the others, who acknowledge it
    assert fleet.collect(0)["action"] == [0.0] * FRAMES and fleet.collect(2)["action"] == [0.0] * FRAMES
    with pytest.raises(ValueError, match="would leave no"):
        fleet.fleet.remove([0, 2])


def test_errors_carried_back(harness):
    fleet = harness(count=2, env_fn=lambda w: (lambda: FaultyEnv(bad=[1], worker_idx=w, after_steps=1)))
    fleet.collect(0)
    with pytest.raises(WorkerError) as info:
        fleet.collect(1)
    err = info.value
    assert err.worker_idx == 1 and isinstance(err, ValueError)  # the remote type is kept
    assert "injected failure" in str(err) and "_step_arrays" in err.remote_traceback
    fleet.collect(0)  # a failure in one worker's env leaves the others working


def test_failure_while_starting_is_reported(harness):
    def broken(worker):
        def make():
            raise RuntimeError(f"no env for worker {worker}")
        return make if worker == 1 else (lambda: CountingEnv())

    with pytest.raises(WorkerError) as info:
        harness(count=2, env_fn=broken)
    assert info.value.worker_idx == 1 and "no env for worker 1" in str(info.value)
