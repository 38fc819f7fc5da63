"""PreemptionCheckpoint without SLURM: the signal is only noted, the loop saves at its next batch
boundary, and a new run resumes from the file exactly (docs/checkpoints.md, "Preemption on SLURM").
The SLURM requeue itself: tests/collectors/distributed/test_slurm_preemption.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch
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
