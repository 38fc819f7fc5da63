"""How a launcher reports that a node ended (the SLURM side runs in test_slurm.py)."""

from __future__ import annotations

import multiprocessing
import os

from rlharvest.collectors.distributed.launchers import LaunchedNode, LocalNode


class RecordingNode(LaunchedNode):
    """A node that never ends, recording how long each look was allowed to wait."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def _ended(self, timeout: float) -> bool:
        self.timeouts.append(timeout)
        return False


def test_ended_waits_only_at_the_first_look():
    # every failure of a node that lives on would otherwise pay the wait again
    node = RecordingNode()
    assert not node.ended()
    assert not node.ended(timeout=2.0)
    assert not node.ended(timeout=2.0)
    assert node.timeouts == [0.0, 2.0, 0.0]


def _exit_with_3() -> None:
    os._exit(3)


def test_local_node_ended_waits_for_the_process_and_says_how():
    process = multiprocessing.get_context("fork").Process(target=_exit_with_3)
    process.start()
    node = LocalNode(process)
    assert node.ended(timeout=30.0)
    assert node.exit_description() == "it exited with code 3"
