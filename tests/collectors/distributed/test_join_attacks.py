"""What a node holding the key file, and a stranger without it, can do to a collector whose nodes join
(``launcher="external"``, docs/security.md), on loopback:

* a node that writes a store key that does not decode is dropped, and its slot goes to the next node;
* a node that holds the key file cannot act as the learner to another node: it cannot sign as it;
* a stranger flooding gloo's port while a pair forms neither swells the learner's descriptors nor
  kills it under ``ulimit -n 1024``;
* a stranger holding connections from several loopback addresses cannot keep a node from joining.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading

import fresh
import psutil
import pytest
from attackers import PortFlooder, marking_env, squatter_process
from mocks import check_trajectories, counting_env_7 as counting_env, wait_until, weight_policy

from rlharvest._node_cli import EXIT_HANDSHAKE
from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.errors import WorkerTimeoutError
from rlharvest.transport.channel import open_channel
from rlharvest.transport.join_keys import read_key_file
from rlharvest.transport.keys import NodeCredential, parse_node_key
from rlharvest.transport.wire import WIRE_FORMAT

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("zygote")]

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS]), "TORCH_CPP_LOG_LEVEL": "ERROR"}


@pytest.fixture
def nodes():
    """Node processes; any still running at the end is killed."""
    started: list = []
    yield started
    for node in started:
        if node.poll() is None:
            node.kill()
        node.wait(30.0)


def start_node(argv: list[str], started: list, **kwargs):
    """The join command, forked from the session's zygote (tests/fresh.py)."""
    node = fresh.popen([sys.executable, *argv[1:]], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, **kwargs)
    started.append(node)
    return node


def joining(**kwargs) -> DistributedCollector:
    options = dict(launcher="external", tcp_port=0, bind_address="127.0.0.1", frames_per_batch=8, total_frames=16,
                   sync=True, worker_timeout=30.0)
    return DistributedCollector([counting_env], weight_policy(1.0), **{**options, **kwargs})


def test_a_node_whose_store_key_does_not_decode_gives_its_slot_back(nodes, caplog):
    """A node holding the key file joins, is given the slot, then writes a pair-store key that is not
    UTF-8: it is dropped, and the next node that joins takes the slot (before: the decode error
    escaped, the slot was never offered again, and every next node was refused)."""
    collector = joining()
    try:
        argv = collector.join_command()
        key = parse_node_key(read_key_file(argv[7]), "--key-file")
        evil = open_channel("127.0.0.1", int(collector.tcp_port), key, 30.0, 10.0)
        evil.send_hello(("join", os.getpid(), "evil", WIRE_FORMAT))
        assert evil.recv()[0] == "slot"
        evil.send_bytes(b"S" + (2).to_bytes(2, "big") + b"\xff\xfe" + b"value")
        wait_until(lambda: evil.poll(0) and _ended(evil), 30.0, "the learner dropping the node")
        start_node(argv, nodes)
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    check_trajectories(batches, 16)
    assert "not UTF-8" in caplog.text


def _ended(channel) -> bool:
    try:
        channel.recv_bytes()
    except (EOFError, OSError):
        return True
    return False


def stolen_key(path: str) -> str:
    """The key a join key file holds, in hex: what an impostor that read it passes as ``authkey``."""
    return NodeCredential.decode(read_key_file(path)).key.hex()


def test_a_node_holding_the_key_file_cannot_act_as_the_learner(nodes, tmp_path):
    """Every node holds the key file. An impostor with it runs a collector of its own with that key,
    on a port a real node is sent to: the node refuses it (it cannot sign as the learner: exit 5) and
    builds none of its envs (before: the node joined the impostor and ran its spec)."""
    marker = tmp_path / "pwned"
    real = joining()
    impostor = None
    try:
        argv = real.join_command()
        impostor = DistributedCollector([functools.partial(marking_env, str(marker), os.getpid())],
                                        weight_policy(1.0), launcher="external", tcp_port=0,
                                        bind_address="127.0.0.1", frames_per_batch=8, total_frames=8, sync=True,
                                        worker_timeout=5.0, authkey=stolen_key(argv[7]))
        served = threading.Thread(target=_first_batch, args=(impostor,), daemon=True)
        served.start()  # the impostor sends its spec to whoever joins it
        node = start_node([*argv[:5], f"127.0.0.1:{impostor.tcp_port}", *argv[6:]], nodes)
        assert node.wait(120.0) == EXIT_HANDSHAKE, node.stderr.read()
        # the node was refused while the impostor still waited for a node (a node forked from the
        # zygote answers in a fraction of a second): its worker_timeout ends the wait, and the test
        assert served.is_alive(), "the impostor stopped waiting before the node came"
        served.join(60.0)
    finally:
        real.shutdown()
        if impostor is not None:
            impostor.shutdown()
    assert not marker.exists(), "a node ran the impostor's spec"


def _first_batch(collector) -> None:
    try:
        next(iter(collector))
    except WorkerTimeoutError:  # no node joined the impostor
        pass


LEARNER = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from mocks import counting_env_7, weight_policy
from rlharvest.collectors.distributed import DistributedCollector
collector = DistributedCollector([counting_env_7], weight_policy(1.0), launcher="external", tcp_port=0,
                                 bind_address="127.0.0.1", frames_per_batch=8, total_frames=16, sync=True,
                                 worker_timeout=90.0)
print(json.dumps(collector.join_command()), flush=True)
print(sum(1 for _ in collector), flush=True)
collector.shutdown()
"""

def test_a_flood_on_gloo_port_while_a_node_pairs_neither_swells_nor_kills_the_learner(nodes):
    """The learner runs under ``ulimit -n 1024``; while a slow node forms its group, a stranger opens
    1,100 connections to the learner's gloo port: the kernel completes none, the learner's
    descriptors stay where they were, and it collects (before: gloo accepted them all, kept them
    for the group's life, and aborted at ``accept: Too many open files``)."""
    learner = subprocess.Popen([sys.executable, "-c", LEARNER], env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    nodes.append(learner)
    argv = json.loads(learner.stdout.readline())
    command_port = int(argv[5].rsplit(":", 1)[1])
    fds = psutil.Process(learner.pid).num_fds()
    flooder = PortFlooder(learner.pid, "127.0.0.1", 1100, ignore={command_port})
    try:
        node = fresh.current().start("attackers:slow_join_node", ["4", *argv[3:]], env=ENV,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        nodes.append(node)
        assert flooder.done.wait(90.0), "the learner never opened gloo's port"
        assert psutil.Process(learner.pid).num_fds() - fds < 40, (psutil.Process(learner.pid).num_fds(), fds)
        out, err = learner.communicate(timeout=150)
    finally:
        flooder.close()
    assert learner.returncode == 0 and out.split()[-1] == "2", err[-3000:]
    assert node.wait(60.0) == 0, node.stderr.read()


def test_a_squatter_on_several_loopback_addresses_cannot_keep_a_node_from_joining(nodes):
    """One process holds 36 idle connections to the command port from 127.0.0.2-5 and retakes each
    one as soon as it is closed: a node joins at once and the collection starts (before: 8 per
    address and 32 in all kept every slot taken until the handshakes timed out, and the squatter
    retook them first: here, with a long handshake timeout, until WorkerTimeoutError)."""
    collector = joining(worker_timeout=15.0, handshake_timeout=30.0)
    squatter = squatter_process(int(collector.tcp_port), [f"127.0.0.{n}" for n in range(2, 6)], 36, ENV)
    nodes.append(squatter)
    try:
        start_node(collector.join_command(), nodes)
        batches = [batch.clone() for batch in collector]
    finally:
        squatter.stdin.close()
        squatter.wait(30.0)
        collector.shutdown()
    check_trajectories(batches, 16)
