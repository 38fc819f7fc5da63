"""A node that holds a collector's key and sends the learner what no honest node sends, and the learner
it attacks; both run as fresh processes forked from the zygote (tests/fresh.py) for
tests/collectors/distributed/test_node_attacks.py (issue 51, docs/security.md "What a node's messages
can do").

* ``hostile_node:node`` with ``sys.argv[1:] = [HOST:PORT, KEY_FILE, ATTACK]`` joins the collector (trying
  again while every slot is taken), sends :data:`ATTACKS` ``[ATTACK]`` and waits (at most 60 s) for the
  learner to close its channel: it exits with 0 then, 2 if the learner kept it.
* ``hostile_node:learner`` with ``sys.argv[1:] = [FOLDER, RESTARTS]`` is a ``DistributedCollector`` of
  one slot (``launcher="external"``), its working folder ``FOLDER``, its address space capped 1.5 GiB
  above what it uses (a bomb fails instead of filling the machine). It prints one JSON line per event
  on stdout: ``{"join": argv}``, ``{"batch": n}`` after each batch until ``RESTARTS`` nodes were
  replaced (the test kills the first node, then attacks), ``{"restart": n}``, and at the end
  ``{"done": ..., "restarts": ..., "imported": [...], "rss_growth": bytes}``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import resource
import struct
import sys
import time

import numpy as np
import torch

#: the modules a failure's type may name to run code in the learner if it imports them
PLANTED = ("this", "unittest.__main__", "antigravity", "test_planted")


def numpy_object_pointer() -> bytes:
    """A pickled numpy array whose dtype, as pickled, says *object* with the flags that make numpy read
    the array's 8 raw bytes (0x41...) as a pointer to a Python object, dereferenced when it is freed:
    156 bytes that killed a learner with SIGSEGV."""
    data = pickle.dumps(np.array([0x4141414141414141], dtype=np.int64), protocol=4)
    flags = b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK"  # the dtype state's (elsize -1, alignment -1), then its flags
    assert data.count(flags + b"\x00") == 1 and data.count(b"\x8c\x02i8") == 1, "numpy pickles arrays otherwise"
    return data.replace(flags + b"\x00", flags + b"\x3d").replace(b"\x8c\x02i8", b"\x8c\x02O8")


def bytearray_bomb(size: int = 1 << 28) -> bytes:
    """46 bytes that unpickle into ``bytearray(size)`` (256 MiB): ``builtins.bytearray`` called with an int."""
    class Bomb:
        def __reduce__(self):
            return bytearray, (size,)
    return pickle.dumps(Bomb(), protocol=4)


def sparse_out_of_range() -> bytes:
    """A pickled sparse tensor whose one index lies far past its size (``to_dense()`` writes there), its
    layout named ``torch.sparse_coo`` (a global any list of torch's layouts lets through) rather than
    through ``torch.serialization._get_layout``."""
    tensor = torch.sparse_coo_tensor(torch.tensor([[1 << 40]]), torch.ones(1), (2,), check_invariants=False)
    data = pickle.dumps(tensor, protocol=4)
    by_name = b"\x8c\x13torch.serialization\x94\x8c\x0b_get_layout\x94\x93\x94\x8c\x10torch.sparse_coo\x94\x85\x94R\x94"
    assert data.count(by_name) == 1 and data[2:3] == b"\x95", "torch pickles sparse tensors otherwise"
    # the same 6 memo entries (3 of them None, popped), then one frame of the new length
    body = data[11:].replace(by_name, b"\x8c\x05torch\x94\x8c\x0asparse_coo\x94\x93\x94" + b"N\x940" * 3)
    return data[:3] + struct.pack("<Q", len(body)) + body


def unchecked_layout(entries: tuple, batch_size: tuple, total_bytes: int):
    """A batch layout as a node may announce one: made without the checks of its class."""
    from rlharvest.data.flat import FlatLayout

    layout = object.__new__(FlatLayout)
    fields = {"entries": entries, "batch_size": batch_size, "names": None, "total_bytes": total_bytes}
    for name, value in fields.items():
        object.__setattr__(layout, name, value)
    return layout


def _send_raw(data: bytes):
    return lambda seat: seat.conn.send_bytes(data)


def _failure_naming(module: str):
    """A start-up failure whose exception type is said to live in ``module`` (sent in the node's own format)."""
    def attack(seat) -> None:
        from rlharvest.errors import RemoteFailure
        from rlharvest.protocol import READY, Reply

        seat.conn.send(Reply(READY, seat.index, failure=RemoteFailure(seat.index, module, "TestProgram", "boom", "")))
    return attack


def _huge_layout(seat) -> None:
    """Start as a node does, then announce a batch of 1 PiB (in its own format): the learner would
    allocate it before the first byte arrives."""
    from rlharvest.data.flat import FlatLayout
    from rlharvest.protocol import READY, Command, Reply

    seat.conn.send(Reply(READY, seat.index, value="ready"))
    size = 1 << 50
    layout = FlatLayout((("observation", torch.uint8, (1, size), 0, size),), (1,), None, size)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and seat.conn.poll(max(0.0, deadline - time.monotonic())):
        message = seat.conn.recv()
        collect = message.command is Command.COLLECT
        seat.conn.send(Reply(message.request_id, seat.index, value=layout if collect else None, frames=int(collect)))
        if collect:
            return


#: what a hostile node sends, by name
ATTACKS = {
    "numpy-object-pointer": lambda seat: _send_raw(numpy_object_pointer())(seat),
    "bytearray-bomb": lambda seat: _send_raw(bytearray_bomb())(seat),
    "failure-naming-a-module": _failure_naming("unittest.__main__"),
    "huge-batch-layout": _huge_layout,
}


def node() -> int:
    from rlharvest.errors import JoinRefused
    from rlharvest.transport.torchdist_join import join_collector

    address, key_file, attack = sys.argv[1:4]
    host, port = address.rsplit(":", 1)
    with open(key_file) as key:
        authkey = bytes.fromhex(key.read().strip())
    deadline = time.monotonic() + 60.0
    while True:
        try:
            seat = join_collector(host, int(port), authkey, timeout=30.0)
            break
        except JoinRefused:  # the slot is not empty yet: the learner is still replacing the last node
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.2)
    ATTACKS[attack](seat)
    while time.monotonic() < deadline:  # until the learner closes the channel
        try:
            if seat.conn.poll(0.5):
                seat.conn.recv_bytes()
        except (EOFError, OSError):
            return 0
    return 2


def _emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class _Restarts(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "restarting node" in record.getMessage():
            self.count += 1
            _emit(restart=self.count)


def _cap_address_space(headroom: int) -> None:
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


def learner() -> int:
    from mocks import counting_env_7

    from rlharvest.collectors.distributed import DistributedCollector

    folder, restarts = sys.argv[1], int(sys.argv[2])
    os.chdir(folder)
    sys.argv = ["learner"]  # what unittest.__main__ would read, if it were imported here
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    handler = _Restarts()
    logging.getLogger("rlharvest").addHandler(handler)
    collector = DistributedCollector([counting_env_7], None, launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=-1, sync=True,
                                     max_worker_restarts=restarts, heartbeat_timeout=10.0, worker_timeout=60.0)
    try:
        _emit(join=collector.join_command())
        _cap_address_space(3 << 29)
        rss = None
        for count, batch in enumerate(collector, 1):  # the test kills the node after the first, then attacks
            assert batch.shape == (1, 8)
            _emit(batch=count)
            rss = rss or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            restarted = collector.stats()["restarts"]
            if restarted >= restarts:  # this batch came from the honest node after the attacks
                break
    finally:
        collector.shutdown()
    _emit(done=True, restarts=restarted, imported=[name for name in PLANTED if name in sys.modules],
          rss_growth=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss)
    return 0
