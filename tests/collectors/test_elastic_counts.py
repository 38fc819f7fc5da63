"""What ``stats()`` counts of a worker that leaves a running collection (docs/elastic.md): everything it
wrote to the replay buffer, once, including the steps of the rollout it was collecting when it left."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from mocks import SlowCountingEnv, counting_env_7 as counting_env, wait_until, weight_policy

from rlharvest.collectors import MultiAsyncCollector
from rlharvest.data import ReplayBuffer

pytestmark = pytest.mark.timeout(90)


class LoggedStepsEnv(SlowCountingEnv):
    """A slow CountingEnv that writes how many steps it took so far to the file ``log``."""

    def __init__(self, log: str, delay: float) -> None:
        super().__init__(max_steps=7, delay=delay)
        self.log = Path(log)
        self.steps = 0

    def _step_arrays(self, actions):
        stepped = super()._step_arrays(actions)
        self.steps += 1
        self.log.write_text(str(self.steps))
        return stepped


def steps_logged(log: Path) -> int:
    text = log.read_text() if log.exists() else ""
    return int(text) if text else 0


def test_a_worker_leaving_mid_rollout_has_every_step_it_wrote_counted_once(tmp_path):
    rollout = 200
    log = tmp_path / "steps"
    slow = functools.partial(LoggedStepsEnv, log=str(log), delay=0.01)  # a rollout takes 2 s
    buffer = ReplayBuffer(10_000)
    collector = MultiAsyncCollector([counting_env, slow], weight_policy(1.0), frames_per_batch=rollout,
                                    total_frames=-1, replay_buffer=buffer)
    try:
        iterator = iter(collector)
        next(iterator), next(iterator)  # the first batches give the buffer its storage, then the workers write
        wait_until(lambda: steps_logged(log) >= rollout + 5, what="the slow worker's second rollout")
        collector.remove_collectors([1])  # cut short mid-rollout: it writes the steps it collected, then closes
        collector.stats(workers="per_worker")  # waits for worker 0's rollout in flight: nothing is written meanwhile
        stats = collector.stats()
        assert 0 < len(buffer) % rollout < rollout - 5  # worker 1's last rollout was cut short and written
        assert stats["replay_written_frames"] == len(buffer)
        next(iterator)
        collector.stats(workers="per_worker")
        assert collector.stats()["replay_written_frames"] == len(buffer)  # and it is never counted again
    finally:
        collector.shutdown()
