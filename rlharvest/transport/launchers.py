"""How nodes get started: local processes (``"mp"``), SLURM jobs (``"submitit"``), or jobs started
elsewhere before the collector exists (``"submitit_delayed"``).

Whatever starts them, every node runs the node entry point the backend is given as its target
(``rlharvest.worker.nodes.node_main``) with only its rank, the world size, the main process's
address and its key: the rest of its configuration arrives over the command channel. The key never
travels over the network (see docs/security.md): ``"mp"`` nodes get their slot's key in their start
arguments, SLURM jobs inside their submitit pickle, in a job folder only its owner can read. A
launched node is represented by a :class:`LaunchedNode`, which answers "is it alive?" and makes
sure it is gone at shutdown. A replacement node is started the same way, one rank at a time.
"""

from __future__ import annotations

import os
from multiprocessing import forkserver, popen_forkserver, spawn
from multiprocessing.context import ForkServerProcess
import socket
import threading
import time
from typing import Callable, Sequence

from .._processes import describe_exit, end_process, mp_context, prepare_worker_process
from .._utils import worker_scheduling
from .rendezvous import distributed_state_exists

__all__ = [
    "DEFAULT_SLURM_CONF",
    "LAUNCHERS",
    "TCP_PORT",
    "LaunchedNode",
    "LocalNode",
    "SlurmNode",
    "NodeTarget",
    "launch_nodes",
    "main_host_ip",
    "private_job_folder",
    "submit_jobs",
]

#: what every node runs: ``target(rank, world_size, host, port, backend, framework, **kwargs)``
NodeTarget = Callable[..., None]
#: SLURM parameters of node jobs (merged under ``slurm_kwargs``)
DEFAULT_SLURM_CONF = {"timeout_min": 10, "slurm_partition": "train", "slurm_cpus_per_task": 32, "slurm_gpus_per_node": 0}
LAUNCHERS = ("mp", "submitit", "submitit_delayed")
#: default base port of the distributed collectors when neither ``tcp_port`` nor ``$TCP_PORT`` is set
TCP_PORT = 10003
#: where submitit keeps the jobs' pickles (they hold the collector's key): only its owner may enter it
JOB_FOLDER = "log_test"
_ALIVE_STATES = {"PENDING", "RUNNING", "UNKNOWN", "COMPLETING", "REQUEUED", "CONFIGURING", "RESIZING", "SUSPENDED"}


def _local_node(death_signal: bool, parent_pid: int | None, target: NodeTarget, *args, **kwargs) -> None:
    if not prepare_worker_process(parent_pid, death_signal):
        return  # the main process died before this node started
    target(*args, **kwargs)


def _node_context(start_method: str | None):
    """How ``"mp"`` nodes start when no start method is given.

    Forking is fastest, but once this process has run torch.distributed (a TCP store, gloo pairs),
    their threads may hold locks at fork time that a forked node would inherit forever: then nodes
    start from the forkserver, one clean process with torch preloaded from which each node is forked.
    """
    if start_method is None:
        start_method = "forkserver" if distributed_state_exists() else "fork"
    ctx = mp_context(start_method)
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["torch", "tensordict", "rlharvest.transport.torchdist", "rlharvest.worker",
                                    "rlharvest.collectors"])
    return ctx


def _warm_forkserver() -> None:
    """Start the forkserver now; it imports its preload list in its own process, in the background.

    Nodes forked before torch.distributed runs here are followed by nodes started from the
    forkserver (replacements). A cold forkserver first imports torch and rlharvest, seconds of CPU
    that take tens of seconds on a loaded machine, and launching a node waits for that without a
    bound: paid at a replacement, it stalls collection while a worker is missing. Started here, it
    has long finished by the time a node fails.
    """
    _node_context("forkserver")
    forkserver.ensure_running()


class _NodePopen(popen_forkserver.Popen):
    """Forkserver launch without re-running the user's ``__main__`` in the node.

    Node targets live in rlharvest and take only primitive arguments, so the main module is not
    needed; importing it would re-execute scripts that lack an ``if __name__ == "__main__"`` guard.
    """

    def _launch(self, process_obj) -> None:
        original = spawn.get_preparation_data

        def without_main(name):
            data = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            super()._launch(process_obj)
        finally:
            spawn.get_preparation_data = original


class _NodeProcess(ForkServerProcess):
    """A forkserver process launched by :class:`_NodePopen`."""

    @staticmethod
    def _Popen(process_obj):
        return _NodePopen(process_obj)


def _process_class(ctx):
    return _NodeProcess if ctx.get_start_method() == "forkserver" else ctx.Process


class LaunchedNode:
    """A started node as its launcher sees it."""

    _end_awaited = False
    #: the node's process id when it is a child process of this one (``"mp"``), else None
    pid: int | None = None

    def is_alive(self) -> bool:
        return True

    def ended(self, timeout: float = 0.0) -> bool:
        """Whether the node has ended, from a fresh look, waiting up to ``timeout`` s for the end.

        For a node whose connection just dropped: its launcher may learn of the end a moment later.
        Only the first call waits, so that the failures of a node that lives on cost that wait once.
        """
        if self._end_awaited:
            timeout = 0.0
        elif timeout > 0:
            self._end_awaited = True
        return self._ended(timeout)

    def _ended(self, timeout: float) -> bool:
        return not self.is_alive()

    def exit_description(self) -> str:
        return "it stopped answering"

    def terminate(self, deadline: float) -> None:
        """Make sure the node is gone by ``deadline`` (monotonic seconds)."""


class LocalNode(LaunchedNode):
    """A node running as a child process of this one."""

    def __init__(self, process) -> None:
        #: the node's process; None once it ended and was released (:meth:`terminate`)
        self.process = process
        self._pid = process.pid
        self._exitcode: int | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def _ended(self, timeout: float) -> bool:
        if self.process is None:
            return True
        self.process.join(timeout)
        return not self.process.is_alive()

    def exit_description(self) -> str:
        return describe_exit(self.process.exitcode if self.process is not None else self._exitcode)

    def terminate(self, deadline: float) -> None:
        """Make sure the process is gone, then release its sentinel (a descriptor, kept otherwise for
        as long as the collector keeps this node's slot)."""
        process = self.process
        if process is None:
            return
        end_process(process, deadline)
        if process.exitcode is not None:
            self._exitcode, self.process = process.exitcode, None
            process.close()


class SlurmNode(LaunchedNode):
    """A node running as a SLURM job submitted with submitit."""

    def __init__(self, job, poll_interval: float = 2.0) -> None:
        self.job = job
        self.poll_interval = poll_interval
        self._state = "PENDING"
        self._checked = 0.0

    def _refresh(self, force: bool = False) -> str:
        now = time.monotonic()
        if force or now - self._checked > self.poll_interval:
            self._checked = now
            try:
                # job.state answers from submitit's cache, refreshed at most every max(2 s, age / 2):
                # a finished job would look RUNNING for up to a minute. Ask sacct when forced.
                state = self.job.watcher.get_state(self.job.job_id, mode="force" if force else "standard")
                self._state = str(state).split()[0].upper()
            except Exception:  # sacct hiccup: keep the last known state
                pass
        return self._state

    def is_alive(self) -> bool:
        return self._refresh() in _ALIVE_STATES

    def _ended(self, timeout: float) -> bool:
        # sacct has a job's end state ~0.1-0.5 s after its processes are gone (a scancel: at once)
        deadline = time.monotonic() + timeout
        while self._refresh(force=True) in _ALIVE_STATES:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        return True

    def exit_description(self) -> str:
        state = self._refresh(force=True)
        tail = ""
        try:
            tail = (self.job.stderr() or "")[-800:]
        except Exception:
            pass
        return f"SLURM job {self.job.job_id} is {state}" + (f"; stderr ends with:\n{tail}" if tail else "")

    def terminate(self, deadline: float) -> None:
        while time.monotonic() < deadline and self._refresh(force=True) in _ALIVE_STATES:
            time.sleep(0.2)
        if self._refresh(force=True) in _ALIVE_STATES:
            try:
                self.job.cancel(check=False)
            except Exception:
                pass
            end = time.monotonic() + 15.0
            while time.monotonic() < end and self._refresh(force=True) in _ALIVE_STATES:
                time.sleep(0.2)


def launch_nodes(launcher: str, ranks: Sequence[int], world_size: int, host: str, port: int, backend: str, *,
                 target: NodeTarget, framework: str = "distributed", slurm_kwargs: dict | None = None,
                 start_method: str | None = None, node_kwargs: dict | None = None,
                 warm_replacements: bool = False) -> list[LaunchedNode]:
    """Start the nodes of ``ranks`` with ``launcher``, each running ``target``.

    ``warm_replacements``: failed nodes will be replaced; forked ``"mp"`` nodes then also start the
    forkserver their replacements come from (seconds of CPU importing torch, spent now rather than
    while a node is missing).

    Raises:
        ValueError: for an unknown launcher, or a bad ``$RLHARVEST_WORKER_SCHED``.
    """
    node_kwargs = node_kwargs or {}
    worker_scheduling()  # a bad RLHARVEST_WORKER_SCHED fails here, not in every node
    args = (world_size, host, port, backend, framework)
    if launcher == "mp":
        ctx = _node_context(start_method)
        forked_here = ctx.get_start_method() == "fork"
        death_signal = forked_here and threading.current_thread() is threading.main_thread()
        parent_pid = os.getpid() if forked_here else None
        nodes = []
        process_class = _process_class(ctx)
        for rank in ranks:
            process = process_class(target=_local_node, args=(death_signal, parent_pid, target, rank, *args),
                                    kwargs=node_kwargs, name=f"rlharvest-node-{rank}", daemon=False)
            process.start()
            nodes.append(LocalNode(process))
        if warm_replacements and forked_here and start_method is None:
            _warm_forkserver()  # after the forks, which so do not inherit its socket
        return nodes
    if launcher == "submitit":
        return [SlurmNode(job) for job in submit_jobs(slurm_kwargs or DEFAULT_SLURM_CONF, target,
                                                     [(rank, *args) for rank in ranks], node_kwargs)]
    if launcher == "submitit_delayed":
        return [LaunchedNode() for _ in ranks]
    raise ValueError(f"launcher must be one of {list(LAUNCHERS)}, got {launcher!r}")


def submit_jobs(conf: dict, target: Callable, argument_lists: list[tuple], kwargs: dict | None = None) -> list:
    """Submit one SLURM job per argument list, each running ``target(*args, **kwargs)``."""
    executor = _executor(conf)
    return [executor.submit(target, *args, **(kwargs or {})) for args in argument_lists]


def private_job_folder(folder: str) -> str:
    """Create ``folder`` (mode 0700) or make sure it is private; submitit's pickles go there.

    Raises:
        PermissionError: when ``folder`` belongs to another user (its pickles would be theirs to
            read or replace).
    """
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.stat(folder)
    if info.st_uid != os.getuid():
        raise PermissionError(f"the submitit job folder {os.path.abspath(folder)!r} belongs to uid {info.st_uid}, "
                              "not to you: its job pickles hold the collector's key. Remove it or run elsewhere.")
    if info.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def _executor(conf: dict, folder: str = JOB_FOLDER):
    try:
        import submitit
    except ImportError as err:
        raise ImportError("launcher='submitit' needs the submitit package: pip install 'rlharvest[slurm]'") from err
    executor = submitit.AutoExecutor(folder=private_job_folder(folder))
    executor.update_parameters(**conf)
    return executor


def main_host_ip() -> str:
    """This machine's address as other hosts should use it."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


