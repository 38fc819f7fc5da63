"""Faults in worker processes: no hang, ever; clear errors naming the worker; no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from mocks import faulty_env_factory, wait_until, weight_policy
from process_check import process_gone

from rlharvest import WorkerError, WorkerTimeoutError
from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_env_exception_is_raised_in_parent_within_a_second(collector_class):
    collector = collector_class(faulty_env_factory(bad=[1], mode="raise", after_steps=20), frames_per_batch=8,
                                total_frames=-1)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        for _ in collector:
            pass
    elapsed = time.monotonic() - start
    err = info.value
    assert err.worker_idx == 1 and "worker 1" in str(err)
    assert isinstance(err, ValueError)  # the remote type is kept
    assert "injected failure" in str(err) and "Traceback" in err.remote_traceback
    assert "FaultyEnv" in err.remote_traceback or "_step_arrays" in err.remote_traceback
    assert elapsed < 5.0  # rollouts of 20 steps take milliseconds: the error arrives as soon as it happens
    collector.shutdown()  # the failing iteration already shut it down; this must be a no-op


def test_error_reported_promptly_timing():
    collector = MultiSyncCollector(faulty_env_factory(bad=[0], mode="raise", after_steps=0), frames_per_batch=8,
                                   total_frames=-1)
    start = time.monotonic()
    with pytest.raises(WorkerError):
        collector.next()
    assert time.monotonic() - start < 1.0
    collector.shutdown()


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_sigkilled_worker_is_detected_within_five_seconds(collector_class):
    collector = collector_class([lambda: CountingEnv(max_steps=100)] * 2, frames_per_batch=8, total_frames=-1)
    try:
        collector.next()
        victim = collector.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="SIGKILL") as info:
            for _ in range(1000):
                collector.next()
        assert info.value.worker_idx == 1
        assert time.monotonic() - start < 5.0
    finally:
        collector.shutdown()
    assert process_gone(victim)


def test_worker_exiting_midway_is_detected():
    collector = MultiSyncCollector(faulty_env_factory(bad=[0], mode="exit", after_steps=2), frames_per_batch=8,
                                   total_frames=-1)
    with pytest.raises(WorkerError, match="exited with code 3"):
        collector.next()
    collector.shutdown()


def test_hanging_worker_raises_timeout_error():
    """The env hangs after two steps: reported worker_timeout after its last step, not twice that
    (the steps it made during the wait used to restart the clock once more at the first check)."""
    collector = MultiSyncCollector(faulty_env_factory(bad=[1], mode="hang", after_steps=2), frames_per_batch=8,
                                   total_frames=-1, worker_timeout=2.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        collector.next()
    elapsed = time.monotonic() - start
    assert isinstance(info.value, WorkerTimeoutError) and info.value.worker_idx == 1
    assert 2.0 <= elapsed < 3.5, f"reported after {elapsed:.1f} s with worker_timeout=2"  # was ~4 s
    assert "no progress for 2." in str(info.value) and "worker_timeout=2 s" in str(info.value)
    start = time.monotonic()
    collector.shutdown(timeout=2.0)  # the hung worker is terminated within the deadline
    assert time.monotonic() - start < 4.0


def test_construction_failure_names_worker_and_keeps_type():
    def make(i):
        def build():
            if i == 1:
                raise KeyError("no such env")
            return CountingEnv()
        return build

    with pytest.raises(WorkerError) as info:
        MultiSyncCollector([make(0), make(1)], frames_per_batch=8)
    assert isinstance(info.value, KeyError) and info.value.worker_idx == 1
    assert "start-up" in str(info.value) and "no such env" in str(info.value)


def test_shutdown_is_idempotent_bounded_and_works_with_dead_workers():
    collector = MultiAsyncCollector([lambda: CountingEnv()] * 2, weight_policy(), frames_per_batch=8, total_frames=-1)
    collector.next()
    pids = collector.worker_pids()
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: process_gone(pids[0]), timeout=5, what="the killed worker's exit")
    start = time.monotonic()
    collector.shutdown(timeout=3.0)
    collector.shutdown()
    assert time.monotonic() - start < 4.0
    for pid in pids:
        assert process_gone(pid)


def test_weight_update_to_dead_worker_raises_instead_of_hanging():
    policy = weight_policy()
    collector = MultiSyncCollector([lambda: CountingEnv()] * 2, policy, frames_per_batch=8, total_frames=-1)
    try:
        collector.next()
        os.kill(collector.worker_pids()[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="worker 0"):
            collector.update_policy_weights_()
        assert time.monotonic() - start < 5.0
    finally:
        collector.shutdown()


def test_bad_weights_are_reported_by_the_worker():
    collector = MultiSyncCollector([lambda: CountingEnv()] * 2, weight_policy(), frames_per_batch=8, total_frames=-1)
    try:
        from tensordict import TensorDict
        import torch

        # right keys on the sender's buffer but a wrong shape: the copy fails in the parent already
        with pytest.raises(Exception):
            collector.update_policy_weights_(TensorDict({"module": {"weight": torch.ones(3)}}, []))
    finally:
        collector.shutdown()


_PARENT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from rlharvest.collectors import MultiSyncCollector
    from rlharvest.envs import CountingEnv
    collector = MultiSyncCollector([lambda: CountingEnv()] * 2, frames_per_batch=8, total_frames=-1)
    collector.next()
    print(" ".join(str(pid) for pid in collector.worker_pids()), flush=True)
    time.sleep(60)
    """
)


def test_workers_exit_when_the_parent_is_sigkilled(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT.format(tests=os.path.dirname(__file__) + "/.."))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait(5)
        wait_until(lambda: all(process_gone(p) for p in pids), timeout=5,
                   what=f"the exit of workers {pids} after their parent was SIGKILLed")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_unknown_command_lists_valid_ones():
    from rlharvest.worker import Message, Worker, WorkerSpec
    from rlharvest.collectors import Collector

    worker = Worker(WorkerSpec(0, Collector, CountingEnv, {"frames_per_batch": 4}))
    reply = worker.handle(Message("explode", 1))
    assert reply.failure is not None and "COLLECT" in reply.failure.message
    err = reply.failure.to_exception()
    assert isinstance(err, WorkerError) and isinstance(err, ValueError)



@pytest.mark.parametrize("remote", [TimeoutError("slow"), ConnectionError("gone"), OSError(5, "io"), KeyError("k")])
def test_a_remote_exception_keeps_its_type_also_an_os_error(remote):
    from rlharvest.errors import RemoteFailure

    err = RemoteFailure.capture(remote, 3).to_exception("'collect'")
    assert isinstance(err, WorkerError) and isinstance(err, type(remote)) and err.worker_idx == 3
    assert f"worker 3: 'collect' failed with {type(remote).__name__}" in str(err)
    with pytest.raises(type(remote)):
        raise err
