"""What a node holding the key can make the main process do with one message on its channel (issue 51,
docs/security.md "What a node's messages can do"): crash it, run code in it, make it allocate what
the node likes. Each message is one that did, received through the channel's public end in a forked
child (tests/forked.py): a crash is a failure naming the signal, not the end of pytest.
"""

from __future__ import annotations

import gc
import os
import resource
import sys

import forked
import hostile_node
import pytest
import torch

from rlharvest.data.flat import FlatLayout
from rlharvest.errors import RemoteFailure, WorkerError
from rlharvest.protocol import Reply
from rlharvest.transport.channel import listen, new_authkey, open_channel
from rlharvest.transport.listener import ChannelListener

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def channels():
    """``(main, node)``: the main process's end of an authenticated channel and a key holder's end."""
    key = new_authkey()
    server = ChannelListener(listen("127.0.0.1", 0), key, "test", handshake_timeout=2.0, user_timeout=5.0)
    node = open_channel("127.0.0.1", server.port, key, 5.0, 5.0, 2.0)
    node.send_hello(("hello", 1))
    main, _, _ = server.next(5.0)
    yield main, node
    for end in (main, node):
        end.close()
    server.close()


def received(main, use=lambda value: None, headroom: int = 256 << 20) -> dict:
    """What the main process made of the message waiting on ``main``, in a forked child: ``"refused: ..."``
    or ``"taken"`` after ``use(value)`` and the value freed, and its peak memory growth (bytes)."""
    def receive(_):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            value = main.recv()
        except ConnectionError as err:
            outcome = f"refused: {err}"
        else:
            use(value)
            del value
            gc.collect()
            outcome = "taken"
        return {"outcome": outcome, "growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024}

    ended = forked.run_each(receive, [None], headroom=headroom)
    assert ended.status == 0 and ended.lines, f"the main process's child died: {ended.why()}"
    assert "value" in ended.lines[0], f"the message raised in the main process: {ended.lines[0]}"
    return ended.lines[0]["value"]


def test_a_numpy_array_whose_pickled_dtype_says_object_is_refused(channels):
    """156 bytes: an array whose 8 raw bytes numpy would free as a pointer (SIGSEGV, as a heartbeat)."""
    main, node = channels
    node.send_bytes(hostile_node.numpy_object_pointer())
    assert received(main)["outcome"].startswith("refused: a pickle")


def test_a_sparse_tensor_indexed_out_of_bounds_is_refused(channels):
    """A sparse tensor rebuilt without its indices checked: ``to_dense()`` wrote out of bounds."""
    main, node = channels
    node.send_bytes(hostile_node.sparse_out_of_range())
    outcome = received(main, use=lambda value: value.to_dense() if isinstance(value, torch.Tensor) else None)
    assert outcome["outcome"].startswith("refused: a pickle")


def test_46_bytes_do_not_become_256_mib(channels):
    """``builtins.bytearray`` called with an int by the unpickler: 46 bytes, 256 MiB."""
    main, node = channels
    bomb = hostile_node.bytearray_bomb()
    assert len(bomb) == 46
    node.send_bytes(bomb)
    outcome = received(main)
    assert outcome["outcome"].startswith("refused: a pickle") and outcome["growth"] < 32 << 20, outcome


def test_a_batch_layout_is_bounded_before_the_main_process_allocates_it(channels):
    """A consistent layout of 1 PiB, sent as a node sends its first batch's: the main process would
    allocate its buffer before receiving a byte of it."""
    main, node = channels
    size = 1 << 50
    node.send(Reply(1, 0, value=FlatLayout((("x", torch.uint8, (1, size), 0, size),), (1,), None, size), frames=1))
    outcome = received(main, use=lambda reply: reply.value.allocate())
    assert outcome["outcome"].startswith(f"refused: a malformed message (ValueError: a batch layout of {size} bytes")


@pytest.mark.parametrize("entries", [
    (("a", torch.float32, (1, 4), 0, 16), ("b", torch.float32, (1, 4), 0, 16)),  # two leaves on the same bytes
    (("a", torch.float32, (1, 4), 0, 64),),  # bytes that are not its shape's
    (("b", torch.float32, (1, 1), 0, 4), ("a", torch.float32, (1, 1), 64, 4)),  # out of key order
    (("a", torch.float32, (2, 1), 0, 8),),  # a shape that does not start with the batch size
])
def test_an_inconsistent_batch_layout_is_refused(channels, entries):
    main, node = channels
    node.send(Reply(1, 0, value=hostile_node.unchecked_layout(entries, (1,), 128), frames=1))
    outcome = received(main, use=lambda reply: reply.value.view(reply.value.allocate()[0]))
    assert outcome["outcome"].startswith("refused: a malformed message (ValueError: not a batch layout"), outcome


def test_a_failure_naming_a_module_imports_nothing(tmp_path):
    """The type of a node's exception names a module: ``this`` (runs when imported) and
    ``unittest.__main__`` (imported a test file planted in the working folder, then ended the process
    with status 0: ``SystemExit`` passes ``except Exception``)."""
    (tmp_path / "test_planted.py").write_text("import pathlib\npathlib.Path('planted-ran').touch()\n")

    def rebuild():
        os.chdir(tmp_path)
        sys.argv = ["learner"]
        errors = [RemoteFailure(0, module, "TestProgram", "boom", "").to_exception("'start-up'")
                  for module in ("this", "unittest.__main__", "unittest.__main__.os")]
        return {"worker_errors": all(isinstance(err, WorkerError) for err in errors),
                "imported": [name for name in hostile_node.PLANTED if name in sys.modules],
                "planted_ran": os.path.exists("planted-ran"), "message": str(errors[0]).splitlines()[0]}

    ended, outcome = forked.run(rebuild)
    assert ended.status == 0 and outcome is not None, ended.why()
    assert outcome == {"value": {"worker_errors": True, "imported": [], "planted_ran": False,
                                 "message": "worker 0: 'start-up' failed with TestProgram: boom"}}, outcome


class _Registering(Exception):
    """An exception class whose subclasses register themselves: making one runs this module's code."""

    made: list = []

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _Registering.made.append(cls)


class _Loaded(ValueError):
    pass


def test_a_failure_is_rebuilt_from_exception_classes_already_loaded_only():
    """A builtin exception or a class of a module already imported still comes back as itself
    (``except ValueError`` works); ``KeyboardInterrupt``, ``SystemExit`` (not an ``Exception``) and a
    class whose subclasses run code do not: a plain WorkerError, nothing run."""
    def rebuilt(module: str, name: str) -> WorkerError:
        return RemoteFailure(3, module, name, "m", "").to_exception()

    assert isinstance(rebuilt("builtins", "ValueError"), ValueError)
    assert isinstance(rebuilt(__name__, "_Loaded"), _Loaded)
    for module, name in (("builtins", "KeyboardInterrupt"), ("builtins", "SystemExit"), ("builtins", "GeneratorExit"),
                         (__name__, "_Registering"), ("os", "path.join"), ("os", "system")):
        err = rebuilt(module, name)
        assert type(err) is WorkerError and isinstance(err, Exception), (module, name, type(err).__mro__)
        assert err.remote_type == f"{module}.{name}"
    assert _Registering.made == []
