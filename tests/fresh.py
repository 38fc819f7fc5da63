"""Fresh processes for the checkpoint tests, forked from a *zygote*: one process per pytest worker that
has imported torch, tensordict, rlharvest and the tests' cases once, and builds nothing.

A resume test needs a process that never saw the collector it resumes. Started with ``python -c``, each
one spent ~3.5 s of CPU importing before it did anything (most of it tensordict importing torch's
compiler); forked from the zygote it starts at once, with the same modules loaded and no collector,
no worker, no thread of the test's process. The zygote is a session fixture (``conftest.zygote``),
started before any test's check of child processes; what each fresh process starts is still checked.

Protocol, one JSON line each way: the test sends ``{"argv", "env", "log"}``; the zygote forks a child
(its own process group, stdout and stderr to ``log``, ``os.environ`` and ``sys.argv`` replaced) that
runs ``checkpoint_cases.main()``, answers ``{"pid"}``, then ``{"returncode"}`` when the child ended.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


class FreshProcessTimeout(AssertionError):
    pass


_current: "Zygote | None" = None


def current() -> "Zygote":
    """The session's zygote (the ``zygote`` fixture of tests/conftest.py starts it)."""
    if _current is None:
        raise RuntimeError("this test needs the zygote fixture (pytest.mark.usefixtures('zygote'))")
    return _current


def start() -> "Zygote":
    global _current
    _current = Zygote()
    return _current


class Zygote:
    """The test's side: start the zygote, run fresh processes from it, stop it."""

    def __init__(self) -> None:
        import rlharvest

        root = Path(rlharvest.__file__).resolve().parents[1]
        path = os.pathsep.join(filter(None, [str(TESTS), str(root), os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen([sys.executable, "-c", "import fresh; fresh.serve()"],
                                        env={**os.environ, "PYTHONPATH": path}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def _answer(self, deadline: float) -> dict:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                raise FreshProcessTimeout("no answer from the fresh process in time")
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"the zygote ended (status {self.process.wait()})")
            return json.loads(line)

    def run(self, argv: list[str], log: Path, timeout: float) -> int:
        """Run ``checkpoint_cases.main()`` with ``argv`` in a fresh process; its exit status. Its output
        goes to ``log``; past ``timeout`` seconds its process group is killed and this raises."""
        deadline = time.monotonic() + timeout
        self.process.stdin.write(json.dumps({"argv": argv, "env": dict(os.environ), "log": str(log)}) + "\n")
        self.process.stdin.flush()
        pid = self._answer(deadline)["pid"]
        try:
            return self._answer(deadline)["returncode"]
        except FreshProcessTimeout:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
            self._answer(time.monotonic() + 30)
            raise

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.process.stdout.close()


def _child(request: dict) -> None:
    """In the forked child: become the fresh process of ``request`` and exit with its status."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-c", *request["argv"]]
    status = 0
    try:
        import checkpoint_cases

        checkpoint_cases.main()
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        import atexit

        atexit._run_exitfuncs()  # what a normal exit runs (multiprocessing's, shared memory's, ...)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve() -> None:
    """The zygote: import, then fork one fresh process per request, one at a time."""
    import checkpoint_cases  # noqa: F401  (torch, tensordict, rlharvest and the cases)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
