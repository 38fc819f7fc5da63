"""How a launcher reports that a node ended (the SLURM side runs in test_slurm.py), and starts local nodes."""

from __future__ import annotations

import multiprocessing
import os
import time

import psutil

from rlharvest.transport.launchers import LaunchedNode, LocalNode
from rlharvest.transport.launchers import launch_nodes


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


def _node_that_exits(*args, **kwargs) -> None:
    """A node target that returns at once."""


def _forkservers() -> list[psutil.Process]:
    return [child for child in psutil.Process().children()
            if "multiprocessing.forkserver" in " ".join(child.cmdline())]


def test_forked_nodes_leave_a_started_forkserver_for_their_replacements():
    # A replacement comes from the forkserver; started cold at that moment it would first import torch.
    nodes = launch_nodes("mp", [1], 2, "127.0.0.1", 1, "gloo", target=_node_that_exits, warm_replacements=True)
    try:
        assert nodes[0].ended(timeout=30.0)
        assert len(_forkservers()) == 1
    finally:
        for node in nodes:
            node.terminate(time.monotonic())
