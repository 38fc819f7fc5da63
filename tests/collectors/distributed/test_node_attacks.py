"""A node holding the collector's key sends the learner what no honest node sends (issue 51,
docs/security.md "What a node's messages can do"): a numpy array whose pickled dtype makes numpy free
a pointer of the node's choosing, 46 bytes that unpickle into 256 MiB, a failure whose exception type
names a module that runs code when imported, a batch layout of 1 PiB. The learner refuses each (the
node is replaced), imports nothing, runs nothing, allocates nothing of the node's choosing, and
collects from the next honest node. The learner and the nodes are fresh processes (tests/fresh.py,
tests/hostile_node.py): an attack that works kills the learner, not this test's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import fresh
import hostile_node
import pytest
from mocks import counting_env_7

from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.transport.channel import open_channel

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("zygote")]

TESTS = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]), "TORCH_CPP_LOG_LEVEL": "ERROR"}


class Learner:
    """The learner's fresh process, its events (JSON lines on stdout) and its log (stderr)."""

    def __init__(self, folder: Path, restarts: int) -> None:
        self.out, self.err = folder / "learner.out", folder / "learner.err"
        self.process = fresh.current().start("hostile_node:learner", [str(folder), str(restarts)], stdout=self.out,
                                             stderr=self.err)

    def events(self) -> list[dict]:
        text = self.out.read_text() if self.out.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def log(self) -> str:
        return self.err.read_text() if self.err.exists() else ""

    def event(self, name: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            found = [event for event in self.events() if name in event]
            if found:
                return found[-1]
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the learner said no {name!r} (status {self.process.poll()}): "
                                     f"{self.log()[-3000:]}")
            time.sleep(0.05)


def test_a_node_with_the_key_can_neither_crash_the_learner_nor_run_code_in_it(tmp_path):
    (tmp_path / "test_planted.py").write_text("import pathlib\npathlib.Path('planted-ran').touch()\n")
    attacks = list(hostile_node.ATTACKS)
    learner = Learner(tmp_path, restarts=len(attacks) + 1)  # the honest node killed, then one per attack
    nodes: list = []
    try:
        join = learner.event("join")["join"]
        nodes.append(fresh.popen(join, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        learner.event("batch")
        nodes[0].kill()
        for attack in attacks:
            hostile = fresh.current().start("hostile_node:node", [join[5], join[7], attack], env=ENV,
                                            stderr=tmp_path / f"{attack}.err")
            nodes.append(hostile)
            status = hostile.wait(120.0)
            assert learner.process.poll() is None, \
                f"{attack} ended the learner (status {learner.process.poll()}): {learner.log()[-3000:]}"
            assert status == 0, f"{attack}: the node ended with {status}: {(tmp_path / f'{attack}.err').read_text()}"
        nodes.append(fresh.popen(join, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        done = learner.event("done", timeout=180.0)
        assert learner.process.wait(60.0) == 0, learner.log()[-3000:]
    finally:
        for node in [learner.process, *nodes]:
            if node.poll() is None:
                node.kill()
            node.wait(30.0)
    log = learner.log()
    assert done["restarts"] == len(attacks) + 1, log[-3000:]
    assert done["imported"] == [] and not (tmp_path / "planted-ran").exists(), done
    assert done["rss_growth"] < 128 << 20, done  # the bomb's 256 MiB were never allocated
    assert log.count("a pickle: the node runs an older rlharvest") == 2, log[-3000:]
    assert "TestProgram: boom" in log and f"a batch layout of {1 << 50} bytes" in log, log[-3000:]


def test_a_node_of_an_older_rlharvest_is_refused_with_a_clear_message(caplog):
    """A node whose messages are pickles (wire format 1) says so by its join hello, which names no
    format: it is refused at once, told why, and takes no slot."""
    collector = DistributedCollector([counting_env_7], None, launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=-1, sync=True)
    try:
        argv = collector.join_command()
        host, port = argv[5].rsplit(":", 1)
        with open(argv[7]) as key_file:
            key = bytes.fromhex(key_file.read().strip())
        old = open_channel(host, int(port), key, 10.0, 10.0, 5.0)
        old.send_hello(("join", os.getpid(), "old-host"))  # rlharvest before wire format 2
        answer = old.recv()
        old.close()
    finally:
        collector.shutdown()
    assert answer[0] == "refused" and "pickles (wire format 1)" in answer[1], answer
    assert "this collector reads wire format 2" in answer[1]
    assert "install the collector's rlharvest version on the node" in answer[1]
