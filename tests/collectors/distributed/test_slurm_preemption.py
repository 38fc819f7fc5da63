"""Preemption of the learner on the real local SLURM cluster (ci/slurm_up.sh): a training job is
requeued (``scontrol requeue``) while it runs, saves at its next batch boundary, and its requeued run
resumes from the checkpoint; together they yield exactly the batches of an uninterrupted run
(docs/checkpoints.md, "Preemption on SLURM")."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from mocks import wait_until

import rlharvest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

ROOT = pathlib.Path(rlharvest.__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parents[2]

# The job: a Collector of CartPole (random actions), one checkpoint file; each run writes the batches
# it yielded to run<SLURM_RESTART_COUNT>.pt, and how many so far to progress<...> (what the test waits on).
TRAIN = textwrap.dedent('''
    import os, sys, time
    import torch
    from rlharvest.collectors import Collector
    from rlharvest.envs import GymEnv
    from rlharvest.preemption import PreemptionCheckpoint

    def make():
        torch.manual_seed(3)  # random actions come from the process's generator
        collector = Collector(GymEnv("CartPole-v1", max_episode_steps=30), None, frames_per_batch=20, total_frames=600)
        collector.set_seed(3)
        return collector

    if __name__ == "__main__":
        out = sys.argv[1]
        run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        collector, batches = make(), []
        with PreemptionCheckpoint(os.path.join(out, "ckpt.pt")) as preemption:
            preemption.resume(collector)
            for batch in collector:
                batches.append(batch.clone())
                with open(os.path.join(out, f"progress{run}"), "w") as progress:
                    progress.write(str(len(batches)))
                time.sleep(0.2)  # a learner's update: the job lasts long enough to be requeued
                if preemption.requested:
                    torch.save(batches, os.path.join(out, f"run{run}.pt"))
                    preemption.save_and_exit(collector)
        torch.save(batches, os.path.join(out, f"run{run}.pt"))
''')


def _progress(folder: pathlib.Path, run: int) -> int:
    path = folder / f"progress{run}"
    text = path.read_text() if path.exists() else ""
    return int(text) if text else 0


def _job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"JobState=(\w+)", out)
    return match.group(1) if match else "GONE"


def test_a_requeued_training_job_resumes_exactly(tmp_path):
    if subprocess.run(["squeue", "-h"], capture_output=True, timeout=10).returncode != 0:
        pytest.fail("no usable SLURM cluster: run ci/slurm_up.sh (or `make services`), or deselect with -m 'not slurm'",
                    pytrace=False)
    (tmp_path / "train.py").write_text(TRAIN)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "-p", "train", "-c", "1", "-o", str(tmp_path / "slurm-%j-%s.out"),
         f"--export=ALL,PYTHONPATH={path}", "--wrap", f"exec {sys.executable} {tmp_path / 'train.py'} {tmp_path}"],
        capture_output=True, text=True, timeout=30, check=True)
    job = submitted.stdout.strip().split(";")[0]
    logs = lambda: "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("slurm-*.out")))  # noqa: E731
    try:
        wait_until(lambda: _progress(tmp_path, 0) >= 4, timeout=90, what=lambda: f"4 batches of job {job}\n{logs()}")
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        # SLURM holds a requeued job back (Reason=BeginTime, ~2 min here): the test lets it start at once
        wait_until(lambda: _job_state(job) == "PENDING", timeout=60, what=lambda: f"job {job} pending again\n{logs()}")
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)
        wait_until(lambda: (tmp_path / "run1.pt").exists() and _job_state(job) in ("COMPLETED", "GONE"), timeout=120,
                   what=lambda: f"the requeued run of job {job} (state {_job_state(job)})\n{logs()}")
    finally:
        subprocess.run(["scancel", job], timeout=30, check=False)
    first, second = (torch.load(tmp_path / f"run{run}.pt", weights_only=False) for run in (0, 1))
    sys.path.insert(0, str(tmp_path))
    try:
        import train  # the job's own code, uninterrupted here
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("train", None)
    reference = [batch.clone() for batch in train.make()]
    assert 4 <= len(first) < len(reference) and sum(b.numel() for b in first + second) == 600
    for index, (want, got) in enumerate(zip(reference, first + second, strict=True)):
        assert bool((want == got).all()), f"batch {index} differs (the checkpoint was after batch {len(first)})"
    ids = torch.cat([b["collector", "traj_ids"] for b in first + second]).tolist()
    assert ids == sorted(ids) and set(ids) == set(range(ids[0], ids[-1] + 1))  # continuous across the requeue
