"""THE worker loop: one handler per command, failures as replies, the identity in its spec; in pull
mode (no transport) and served over the in-process backend. Milliseconds, no process."""

from __future__ import annotations

import time

import pytest
from mocks import CountingPolicy, FaultyEnv

from rlharvest.collectors import Collector
from rlharvest.collectors.engine.requests import WorkerRequests
from rlharvest.envs import CountingEnv
from rlharvest.protocol import FREE_BATCH, LEAVING, READY, Command, Message, WorkerSpec
from rlharvest.transport.base import WorkerEndpoint
from rlharvest.transport.inprocess import InProcessBackend
from rlharvest.worker import Worker, run_worker

pytestmark = pytest.mark.timeout(30)

_IDS = ("collector", "traj_ids")


def spec(**changes) -> WorkerSpec:
    fields = dict(worker_idx=0, collector_class=Collector, create_env_fn=lambda: CountingEnv(max_steps=2),
                  collector_kwargs={"frames_per_batch": 4}, policy=CountingPolicy())
    return WorkerSpec(**{**fields, **changes})


def collect(worker: Worker, random: bool = False):
    reply = worker.handle(Message(Command.COLLECT, 7, (random, 0)))
    assert reply.failure is None and reply.request_id == 7
    return reply


def test_collect_replies_with_the_batch_and_its_frames():
    reply = collect(Worker(spec()))
    assert reply.frames == 4 and not reply.written
    assert reply.value.get("observation").reshape(-1).tolist() == [0, 1, 2, 0]


def test_identity_comes_from_the_spec():
    worker = Worker(spec(traj_offset=100, policy_version=5, collector_kwargs={"frames_per_batch": 4,
                                                                               "track_policy_version": True}))
    batch = collect(worker).value
    assert batch.get(_IDS).tolist() == [100, 100, 100, 101]
    assert batch.get("policy_version").tolist() == [5] * 4
    assert worker.collector.policy_version == 5


def test_a_seeded_spec_gives_the_same_rollouts():
    # one process: each worker is built (and seeded) right before it collects, as in its own process
    kwargs = {"frames_per_batch": 32}
    first = collect(Worker(spec(seed=3, collector_kwargs=kwargs)), random=True).value.get("action").clone()
    second = collect(Worker(spec(seed=3, collector_kwargs=kwargs)), random=True).value.get("action")
    assert (first == second).all() and first.unique().numel() == 2  # random, and the same


def test_a_failing_handler_becomes_a_failure_reply_and_the_worker_goes_on():
    worker = Worker(spec(create_env_fn=lambda: FaultyEnv(bad=[0], worker_idx=0, after_steps=6)))
    collect(worker)
    reply = worker.handle(Message(Command.COLLECT, 8, (False, 0)))
    assert reply.failure is not None and reply.failure.type_name == "ValueError"
    assert "injected failure" in reply.failure.message and "_step_arrays" in reply.failure.traceback
    assert worker.handle(Message(Command.GETATTR_ENV, 9, "max_steps")).value == 4


def test_commands_reach_their_handlers():
    worker = Worker(spec())
    assert worker.handle(Message(Command.SEED, 1, (5, False))).value == 6  # CountingEnv returns seed + 1
    assert worker.handle(Message(Command.GETATTR_POLICY, 2, "action_key")).value == "action"
    state = worker.handle(Message(Command.STATE_DICT, 3)).value
    assert state["frames"] == 0 and "policy_state_dict" in state
    assert worker.handle(Message(Command.CASCADE, 4, ("env.max_steps", (), {}))).value == 2
    assert worker.handle(Message(Command.CLOSE, 5)).value == "closed" and worker.closed


# ------------------------------------------------------------------------------ served over a backend
@pytest.fixture
def served():
    backends = []

    def start(*specs: WorkerSpec) -> WorkerRequests:
        backend = InProcessBackend(len(specs), run_worker)
        backends.append(backend)
        return WorkerRequests(backend.start_all(list(specs)), timeout=10.0)

    yield start
    for backend in backends:
        backend.stop_all(time.monotonic() + 5.0)


def test_ready_once_built_or_the_failure_that_stopped_it(served):
    def broken():
        raise RuntimeError("no env today")

    pool = served(spec(), spec(worker_idx=1, create_env_fn=broken))
    assert pool.wait_for(0, READY).value == "ready"
    with pytest.raises(RuntimeError, match="no env today") as info:
        pool.wait_for(1, READY)
    assert info.value.worker_idx == 1


def test_running_free_pushes_batches_until_paused(served):
    pool = served(spec())
    pool.wait_for(0, READY)
    assert pool.request(0, Command.RUN_FREE) == "running"
    pushed = [pool.next_pushed(5.0) for _ in range(3)]
    assert all(reply.request_id <= FREE_BATCH and reply.frames == 4 for _, reply in pushed)
    assert pool.request(0, Command.PAUSE) == "paused"
    while pool.next_pushed(0.3) is not None:  # what was pushed before the pause (a bounded drain)
        pass
    assert pool.next_pushed(0.3) is None
    assert pool.request(0, Command.CLOSE) == "closed"


def test_the_worker_returns_when_its_parent_is_gone(served):
    pool = served(spec())
    pool.wait_for(0, READY)
    handle = pool.handles[0]
    handle.conn.close()
    handle.thread.join(5.0)
    assert not handle.is_alive()


class HeldBatchEndpoint(WorkerEndpoint):
    """A node's end whose last batch leaves only while the worker applies weight updates: its parent
    waits for the acknowledgement of an update before it takes the batch."""

    def __init__(self) -> None:
        self.worker_idx = 0
        self.sent: list = []
        self.held = False  # a batch published and not taken yet
        self.idle_calls = 0

    def recv(self, timeout: float):
        return None

    def send(self, message) -> None:
        self.sent.append(message)

    def publish_batch(self, batch):
        self.held = True
        return batch

    def before_rollout(self, idle=None) -> None:
        if self.held and idle is None:
            raise TimeoutError("the last batch never left: the parent waits for an acknowledgement meanwhile")
        if self.held:
            idle()
            self.idle_calls += 1
        self.held = False


def test_a_preempted_worker_applies_weight_updates_while_its_last_batch_waits_to_leave():
    """A node preempted (SIGTERM) after it delivered a batch waits until that batch is taken before it
    says it leaves; a parent that meanwhile waits for this node's acknowledgement of an update takes the
    batch only after it: without the updates applied meanwhile both waited, until the node's send timed
    out (60 s, seen in benchmarks/soak.py; docs/elastic.md, "Preemption")."""
    endpoint = HeldBatchEndpoint()
    worker = Worker(spec(preemption_grace=2.0), endpoint)
    collect(worker)  # a batch delivered
    worker.preempt()
    worker.serve(idle_timeout=0.01)
    assert endpoint.idle_calls == 1
    leaving = [reply for reply in endpoint.sent if reply.request_id == LEAVING]
    assert [reply.value for reply in leaving] == ["finished"]
