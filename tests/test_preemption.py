"""PreemptionCheckpoint without SLURM: the signal is only noted, the loop saves at its next batch
boundary, and a new run resumes from the file exactly (docs/checkpoints.md, "Preemption on SLURM").
The SLURM requeue itself: tests/collectors/distributed/test_slurm_preemption.py."""

from __future__ import annotations

import os
import signal

import pytest
from mocks import CountingPolicy

from rlharvest.collectors import Collector
from rlharvest.envs import CountingEnv
from rlharvest.preemption import PreemptionCheckpoint

pytestmark = pytest.mark.timeout(60)


def make() -> Collector:
    collector = Collector(CountingEnv(max_steps=6, batch_size=(2,)), None, frames_per_batch=8, total_frames=80)
    collector.set_seed(1)
    return collector


def test_a_signal_is_noted_and_the_run_saves_then_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    reference = [batch.clone() for batch in make()]
    path = tmp_path / "ckpt.pt"
    policy = CountingPolicy(2.0)
    collector, first = make(), []
    with PreemptionCheckpoint(path) as preemption:
        assert not preemption.resume(collector)  # first run: nothing to load
        for batch in collector:
            first.append(batch.clone())
            if len(first) == 3:
                os.kill(os.getpid(), signal.SIGUSR1)  # what --signal=USR1@... sends
            if preemption.requested:
                with pytest.raises(SystemExit) as exited:
                    preemption.save_and_exit(collector, learner=policy)
                assert exited.value.code == 0 and preemption.signal is signal.SIGUSR1
                break
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers put back
    assert path.exists() and not path.with_name("ckpt.pt.partial").exists()
    collector, learner = make(), CountingPolicy(1.0)
    with PreemptionCheckpoint(path) as preemption:
        assert preemption.resume(collector, learner=learner)
        rest = [batch.clone() for batch in collector]
    assert float(learner.weight.detach()) == 2.0
    assert len(first) + len(rest) == len(reference) == 10
    for want, got in zip(reference, first + rest, strict=True):
        assert (want == got).all()


def _ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (its SigIgn mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    return bool(mask >> (sig - 1) & 1)


def test_local_workers_do_not_die_of_the_learners_usr1(tmp_path, monkeypatch):
    """SIGUSR1 (SLURM's --signal=USR1@...) may reach the workers too (a signal to the job's processes):
    they ignore it, the learner saves at the next batch boundary and the run resumes exactly."""
    from rlharvest.collectors import MultiSyncCollector

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def make_multi():
        collector = MultiSyncCollector([CountingEnv] * 2, CountingPolicy(), frames_per_batch=8, total_frames=48)
        collector.set_seed(1)
        return collector

    reference = make_multi()
    expected = [batch.clone() for batch in reference]
    reference.shutdown()
    path, collector, first = tmp_path / "ckpt.pt", make_multi(), []
    with PreemptionCheckpoint(path) as preemption:
        for batch in collector:
            first.append(batch.clone())
            if len(first) == 2:
                pids = collector.worker_pids()
                assert all(_ignores(pid, signal.SIGUSR1) for pid in pids)
                for pid in [*pids, os.getpid()]:
                    os.kill(pid, signal.SIGUSR1)
            if preemption.requested and len(first) == 3:  # a batch after the signal: the workers lived on
                assert all(_ignores(pid, signal.SIGUSR1) for pid in collector.worker_pids())
                with pytest.raises(SystemExit):
                    preemption.save_and_exit(collector)
                break
    collector = make_multi()
    with PreemptionCheckpoint(path) as preemption:
        assert preemption.resume(collector)
        rest = [batch.clone() for batch in collector]
    collector.shutdown()
    assert len(first) == 3 and len(first) + len(rest) == len(expected) == 6  # saved after the batch that followed
    ids = ("collector", "traj_ids")  # new episodes' ids come from a shared counter, in the order workers get there
    for want, got in zip(expected, first + rest, strict=True):
        assert (want.exclude(ids) == got.exclude(ids)).all()
