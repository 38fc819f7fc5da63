"""Run code that may crash in forked children of the test's process, and say how each ended.

The tests of what the main process decodes from nodes (tests/transport/test_node_messages.py,
test_node_fuzz.py) feed it bytes that crashed it before (a numpy pointer, a sparse tensor written out
of bounds, 46 bytes that became 256 MiB): in a child, a crash is a test failure naming the signal,
not the end of pytest. Each child gets an address-space cap (``RLIMIT_AS``, above what it uses when
it starts), so an allocation past it fails there instead of filling the machine, and a deadline.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass
class Ended:
    """How a child ended: ``status`` as ``subprocess`` says it (negative: the signal that killed it,
    None: killed at the deadline), and the JSON lines it wrote (one per case)."""

    status: int | None
    lines: list = field(default_factory=list)

    def why(self) -> str:
        if self.status is None:
            return "it ran past its deadline"
        if self.status < 0:
            return f"it was killed by {signal.Signals(-self.status).name}"
        return f"it exited with {self.status}"


def _cap_memory(headroom: int) -> None:
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


def run_each(function: Callable[[Any], Any], cases: Iterable, *, headroom: int = 256 << 20,
             timeout: float = 60.0) -> Ended:
    """``function(case)`` for each case, in one forked child, which writes one JSON line per case:
    ``{"value": what it returned}`` or ``{"raised": type name, "message": ...}`` (any BaseException).
    The child ends as soon as one case crashes it: the lines tell which cases it finished."""
    cases = list(cases)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 0
        try:
            os.close(read)
            _cap_memory(headroom)
            for case in cases:
                try:
                    outcome = {"value": function(case)}
                except BaseException as err:  # noqa: B036 (what escapes is the point)
                    outcome = {"raised": type(err).__name__, "message": str(err)[:300]}
                os.write(write, (json.dumps(outcome, default=repr) + "\n").encode())
        except BaseException:
            status = 70
        finally:
            os._exit(status)
    os.close(write)
    deadline, output = time.monotonic() + timeout, b""
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return Ended(None, _lines(output))
            chunk = pipe.read(1 << 16)
            if not chunk:
                break
            output += chunk
    _, status = os.waitpid(pid, 0)
    return Ended(os.waitstatus_to_exitcode(status), _lines(output))


def run(function: Callable[[], Any], **kwargs) -> tuple[Ended, dict | None]:
    """``function()`` in a forked child: how it ended, and its one outcome (None if it crashed)."""
    ended = run_each(lambda _: function(), [None], **kwargs)
    return ended, (ended.lines[0] if ended.lines else None)


def _lines(output: bytes) -> list:
    return [json.loads(line) for line in output.decode().splitlines()]
