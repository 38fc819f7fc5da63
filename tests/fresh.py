"""Fresh processes forked from a *zygote*: one process per pytest worker that has imported torch,
tensordict, rlharvest and the tests' cases once, and builds nothing.

Two kinds of tests need a process of their own that starts from nothing: a resume test (a process that
never saw the collector it resumes: ``checkpoint_cases.main()``) and a join test (``python -m rlharvest
node --join ...``, what a user runs on another machine). Started with ``python``, each spent ~3.5 s of
CPU importing before it did anything (most of it tensordict importing torch's compiler); forked from the
zygote it starts at once, with the same modules loaded and no collector, no worker, no thread of the
test's process. The zygote is a session fixture (``conftest.zygote``), started before any test's check
of child processes; what it forks is checked like any child. The node command's own tests
(``test_node_command.py``, ``test_cli.py``) still start real interpreters.

Protocol, one JSON line each way. The test sends ``{"id", "target", "argv", "env", "stdout",
"stderr"}``; the zygote forks a child (its own process group, ``os.environ`` and ``sys.argv``
replaced, output to the files named or to the zygote's stderr) that calls ``target`` (``module:function``)
and exits with what it returns, and answers ``{"id", "pid"}``; later ``{"id", "returncode"}`` when that
child ended (negative: killed by that signal, as :class:`subprocess.Popen` says it).
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
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


def popen(argv: list[str], env: dict | None = None, stdout=None, stderr=None, text: bool = False) -> "FreshProcess":
    """``subprocess.Popen(argv, ...)`` for ``argv = [python, "-m", "rlharvest", ...]`` (a join command),
    forked from the session's zygote. ``stdout``/``stderr``: None (the zygote's stderr),
    ``subprocess.DEVNULL`` or ``subprocess.PIPE`` (read once the process ended)."""
    if argv[1:3] != ["-m", "rlharvest"]:
        raise ValueError(f"fresh.popen runs `python -m rlharvest ...`, got {argv}")
    return current().start("rlharvest.cli:main", argv[3:], env, stdout, stderr, text, args=argv)


class _Output:
    """What a fresh process wrote to a file, read like a pipe: :meth:`read` waits for its end."""

    def __init__(self, process: "FreshProcess", path: str, text: bool) -> None:
        self._process, self._path, self._text, self.closed = process, path, text, False

    def read(self):
        self._process.wait(120.0)
        data = Path(self._path).read_bytes()
        return data.decode(errors="replace") if self._text else data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            Path(self._path).unlink(missing_ok=True)  # else the zygote's close() removes it


class FreshProcess:
    """The parts of :class:`subprocess.Popen` the tests use, for a process the zygote forked."""

    def __init__(self, zygote: "Zygote", request: int, pid: int, args: list[str], outputs: dict[str, str],
                 text: bool) -> None:
        self._zygote, self._request, self.pid, self.args, self.returncode = zygote, request, pid, args, None
        self.stdout = _Output(self, outputs["stdout"], text) if "stdout" in outputs else None
        self.stderr = _Output(self, outputs["stderr"], text) if "stderr" in outputs else None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self._request, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self._request, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still this process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test's side: start the zygote, fork fresh processes from it, stop it. Thread-safe."""

    def __init__(self) -> None:
        import rlharvest

        root = Path(rlharvest.__file__).resolve().parents[1]
        path = os.pathsep.join(filter(None, [str(TESTS), str(root), os.environ.get("PYTHONPATH")]))
        self.path = path  # a fresh process's PYTHONPATH unless told otherwise: the tests' modules too
        self.process = subprocess.Popen([sys.executable, "-c", "import fresh; fresh.serve()"],
                                        env={**os.environ, "PYTHONPATH": path}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self._ids = itertools.count()
        self._changed = threading.Condition()
        self._writing = threading.Lock()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._ended: dict[int, int] = {}  # request id -> returncode (a pid may be reused)
        self._gone = False
        self._outputs = tempfile.TemporaryDirectory(prefix="fresh-")  # what PIPE means here, until close()
        self._reader = threading.Thread(target=self._read, name="zygote-answers", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            answer = json.loads(line)
            with self._changed:
                if "pid" in answer:
                    self._pids[answer["id"]] = answer["pid"]
                else:
                    self._ended[answer["id"]] = answer["returncode"]
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def _until(self, ready, timeout: float | None, what: str):
        """Wait for ``ready()`` (under the lock) to be not None; None after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while (value := ready()) is None:
                if self._gone:
                    raise AssertionError(f"the zygote ended (status {self.process.wait()}) before {what}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
            return value

    def start(self, target: str, argv: list[str], env: dict | None = None, stdout=None, stderr=None,
              text: bool = False, args: list[str] | None = None) -> FreshProcess:
        """Fork a process that runs ``target()`` (``"module:function"``) with ``sys.argv[1:] = argv``."""
        outputs = {}
        for name, where in (("stdout", stdout), ("stderr", stderr)):
            if where == subprocess.PIPE:
                handle, outputs[name] = tempfile.mkstemp(prefix=f"{name}-", dir=self._outputs.name)
                os.close(handle)
            elif where == subprocess.DEVNULL:
                outputs[name] = os.devnull
            elif isinstance(where, (str, os.PathLike)):
                outputs[name] = str(where)
            elif where is not None:
                raise ValueError(f"{name} must be None, DEVNULL, PIPE or a path, got {where!r}")
        request = next(self._ids)
        env = dict(env or {**os.environ, "PYTHONPATH": self.path})
        line = json.dumps({"id": request, "target": target, "argv": argv, "env": env, **outputs}) + "\n"
        with self._writing:
            self.process.stdin.write(line)
            self.process.stdin.flush()
        pid = self._until(lambda: self._pids.pop(request, None), 60.0, "forking")
        if pid is None:
            raise FreshProcessTimeout("the zygote did not fork in 60 s")
        piped = {name: path for name, path in outputs.items() if path != os.devnull and
                 (stdout if name == "stdout" else stderr) == subprocess.PIPE}
        return FreshProcess(self, request, pid, args or [target, *argv], piped, text)

    def returncode(self, request: int, timeout: float | None) -> int | None:
        """The exit status of the process forked for ``request``, waiting up to ``timeout`` seconds."""
        return self._until(lambda: self._ended.get(request), timeout, f"fresh process {request} ended")

    def run(self, argv: list[str], log: Path, timeout: float) -> int:
        """Run ``checkpoint_cases.main()`` with ``argv`` in a fresh process; its exit status. Its output
        goes to ``log``; past ``timeout`` seconds its process group is killed and this raises."""
        process = self.start("checkpoint_cases:main", argv, stdout=log, stderr=log)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(30.0)
            raise FreshProcessTimeout(f"the fresh process did not end within {timeout} s") from None

    def close(self) -> None:
        self.process.stdin.close()  # the zygote kills what it forked that still runs, and exits
        self.process.wait(timeout=30)
        self._reader.join(10.0)
        self.process.stdout.close()
        self._outputs.cleanup()


# ------------------------------------------------------------------------------------- the zygote
def _child(request: dict) -> None:
    """In the forked child: become the fresh process of ``request`` and exit with its status."""
    os.setsid()
    _redirect(os.devnull, 0, os.O_RDONLY)
    if request.get("stdout"):
        _redirect(request["stdout"], 1, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    else:
        os.dup2(2, 1)  # the zygote's stdout carries its answers: nothing else may write there
    if request.get("stderr") and request["stderr"] == request.get("stdout"):
        os.dup2(1, 2)
    elif request.get("stderr"):
        _redirect(request["stderr"], 2, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.environ.clear()
    os.environ.update(request["env"])
    module, _, function = request["target"].partition(":")
    sys.argv = ["-c" if module == "checkpoint_cases" else module.split(".")[0], *request["argv"]]
    status = 0
    try:
        returned = getattr(importlib.import_module(module), function)()
        status = returned if isinstance(returned, int) else 0
    except SystemExit as exit:  # as the interpreter ends on it
        status = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if status == 1 and not isinstance(exit.code, int):
            print(exit.code, file=sys.stderr)
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


def _redirect(path: str, fd: int, flags: int) -> None:
    opened = os.open(path, flags, 0o600)
    os.dup2(opened, fd)
    os.close(opened)


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> None:
    """The zygote: import, then fork one fresh process per request; report each one's end. When the
    test's side closes stdin, kill the process groups still running, reap them and exit."""
    import checkpoint_cases  # noqa: F401  (torch, tensordict, rlharvest and the cases)
    import rlharvest.cli  # noqa: F401

    running: dict[int, int] = {}  # pid -> request id
    pending = b""
    closed = False
    while not closed or running:
        if not closed and select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 1 << 16)
            if not data:
                closed = True
                for pid in running:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                running[pid] = request["id"]
                _answer({"id": request["id"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, 0 if closed else os.WNOHANG)
            if pid == 0:
                break
            _answer({"id": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})
