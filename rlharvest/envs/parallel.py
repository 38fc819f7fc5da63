"""ParallelEnv: one worker process per sub-env, one wake-up per sub-env per step, nothing pickled per step.

Per step the env writes the actions into shared buffers, writes one command byte to each sub-env's
pipe, and sleeps until the last sub-env to answer wakes it (one wake-up per round, see
``ReplyBoard``); the sub-envs read their actions from, and write their outcomes into, their rows of
the shared buffers (see ``_subenv_worker.py``). Pickled messages only travel at start (each sub-env describes itself),
once after the first step (the outcome buffers), and for seeds.

Failures follow the rules of the worker collectors: an exception in a sub-env is raised here as a
:class:`~rlharvest.errors.WorkerError` naming the sub-env and carrying its traceback (and the
original type); a sub-env process that dies is noticed at once (its sentinel is part of every
wait) and one that hangs after ``worker_timeout``; sub-env processes die with their parent, and
``close()`` (also run at interpreter exit) leaves none behind.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing  # noqa: F401  (imported before our exit hook so that hook runs first)
import os
import select
import time
import weakref
from typing import Any, Sequence

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that share tensors through pipes)

from .._processes import describe_process_exit, end_process, mp_context, parent_watch
from .._utils import CloudpickleWrapper, worker_scheduling
from ..errors import RemoteFailure, WorkerError, WorkerTimeoutError
from ._subenv_protocol import PAYLOAD_COMMANDS, ReplyBoard, Status, SubEnvCommand, SubEnvDescription
from ._subenv_worker import subenv_main
from .batched import BatchedEnvBase, BatchedEnvConfig, SerialEnv, SubEnvPool

__all__ = ["ParallelEnv"]

_NOUN = "sub-env"
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_envs() -> None:
    """At interpreter exit, close what users forgot (multiprocessing would otherwise wait for them)."""
    for env in list(_LIVE):
        with contextlib.suppress(Exception):
            env.close(raise_if_closed=False)


def _subenv_seeds(config: BatchedEnvConfig) -> list[int]:
    """Seeds of the sub-env processes' global generators: reproducible, distinct per env and sub-env."""
    entropy = [torch.initial_seed() % 2**63, config.env_id]
    states = np.random.SeedSequence(entropy).spawn(config.num_workers)
    return [int(state.generate_state(1, dtype=np.uint64)[0] % 2**63) for state in states]


class ProcessPool(SubEnvPool):
    """One process per sub-env; commands as bytes on pipes, data in shared memory."""

    shared = True

    def __init__(self, config: BatchedEnvConfig) -> None:
        worker_scheduling()  # a bad $RLHARVEST_WORKER_SCHED fails here, not in the sub-envs
        self.config = config
        self.ctx = mp_context(config.mp_start_method)
        self.processes: list = []
        self.commands: list = []  # our write ends of the command pipes
        self.conns: list = []     # our read ends of the result pipes
        self._fds: list[int] = []
        self.board = ReplyBoard(self.ctx, config.num_workers)
        self._status = self.board.status.numpy()
        self._remaining = self.board.remaining.numpy()
        self._codes = {command: bytes([command]) for command in SubEnvCommand}
        self._broken: WorkerError | None = None
        self._closed = False
        self._poller = None

    # ------------------------------------------------------------------ start
    def start(self) -> list[SubEnvDescription]:
        config, ctx = self.config, self.ctx
        parent_pid, death_signal = parent_watch(ctx)
        seeds = _subenv_seeds(config)
        for index in range(config.num_workers):
            # Two one-way pipes rather than a socket pair: a pipe write that wakes the sub-env costs
            # the parent a third of a socket write's time (measured: 5-10 us against 17-33 us).
            command_r, command_w = ctx.Pipe(duplex=False)
            result_r, result_w = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=subenv_main,
                args=(index, CloudpickleWrapper(config.create_env_fns[index]), config.create_env_kwargs[index],
                      command_r, result_w, self.board, parent_pid, death_signal, config.num_sub_threads,
                      seeds[index]),
                name=f"rlharvest-subenv-{index}", daemon=config.daemon,
            )
            process.start()
            command_r.close()
            result_w.close()
            self.processes.append(process)
            self.commands.append(command_w)
            self.conns.append(result_r)
            self._fds.append(command_w.fileno())
        self.board.reply_w.close()  # only sub-envs write replies
        deadline = time.monotonic() + config.worker_timeout
        descriptions = [self._hello(index, deadline) for index in range(config.num_workers)]
        self._poller = select.poll()
        self._poller.register(self.board.reply_r.fileno(), select.POLLIN)
        self._sentinels = {process.sentinel: index for index, process in enumerate(self.processes)}
        for sentinel in self._sentinels:
            self._poller.register(sentinel, select.POLLIN)
        return descriptions

    def _hello(self, index: int, deadline: float) -> SubEnvDescription:
        conn, process = self.conns[index], self.processes[index]
        while True:
            try:
                if conn.poll(0.1):
                    message = conn.recv()
                    break
            except (EOFError, OSError):
                raise self._death(index, "while starting") from None
            if not process.is_alive() and not conn.poll(0):
                raise self._death(index, "while starting")
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(f"not started within worker_timeout={self.config.worker_timeout:g} s.",
                                         worker_idx=index, noun=_NOUN)
        if isinstance(message, RemoteFailure):
            raise message.to_exception(context="building the sub-env", noun=_NOUN)
        return message

    def _death(self, index: int, doing: str) -> WorkerError:
        return WorkerError(f"the sub-env process died {doing}: {describe_process_exit(self.processes[index])}.",
                           worker_idx=index, noun=_NOUN)

    # ------------------------------------------------------------------ commands
    def run(self, command: SubEnvCommand, workers: Sequence[int], payload: Any = None) -> dict[int, Any]:
        if self._broken is not None:
            raise self._broken
        code, status, fds = self._codes[command], self._status, self._fds
        status[workers] = Status.WAITING
        self._remaining[0] = len(workers)  # every sub-env is idle between rounds: no lock needed
        worker = -1
        try:
            if command in PAYLOAD_COMMANDS:
                for worker in workers:
                    os.write(fds[worker], code)
                    self.commands[worker].send(payload)
            else:
                for worker in workers:
                    os.write(fds[worker], code)
        except OSError:
            self._broken = self._death(worker, f"before {command.name.lower()!r}")
            raise self._broken from None
        self._wait(workers, command)
        if not status.any():  # the usual case: every sub-env answered OK, nothing to read
            return {}
        results, failure = {}, None
        for worker in np.flatnonzero(status).tolist():
            message = self.conns[worker].recv()
            if status[worker] == Status.FAILED:
                failure = failure or message
            else:
                results[worker] = message
        status[...] = Status.OK
        if failure is not None:
            raise failure.to_exception(context=repr(command.name.lower()), noun=_NOUN)
        return results

    def _wait(self, workers: Sequence[int], command: SubEnvCommand) -> None:
        """Until the last sub-env of the round answered; a dead or hung sub-env breaks the env."""
        reply_fd, poller, remaining = self.board.reply_r.fileno(), self._poller, self._remaining
        timeout = self.config.worker_timeout
        deadline = time.monotonic() + timeout
        while True:
            events = poller.poll(max(0.0, min(deadline - time.monotonic(), 1.0)) * 1000.0)
            for fd, _ in events:
                if fd == reply_fd:
                    os.read(reply_fd, 64)
                else:
                    self._broken = self._death(self._sentinels[fd], f"while handling {command.name.lower()!r}")
                    raise self._broken
            if remaining[0] <= 0:
                return
            if time.monotonic() > deadline:
                waiting = [w for w in workers if self._status[w] == Status.WAITING]
                self._broken = WorkerTimeoutError(
                    f"no answer to {command.name.lower()!r} within worker_timeout={timeout:g} s.",
                    worker_idx=waiting[0] if waiting else None, noun=_NOUN)
                raise self._broken

    # ------------------------------------------------------------------ close
    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        for index, process in enumerate(self.processes):
            if self._broken is None and process.is_alive():
                with contextlib.suppress(OSError):
                    os.write(self._fds[index], bytes([SubEnvCommand.CLOSE]))
        if self._broken is not None:  # a sub-env failed: the others are not waited for
            deadline = time.monotonic()
        for process in self.processes:
            end_process(process, deadline)
        for conn in [*self.commands, *self.conns, self.board.reply_r]:
            with contextlib.suppress(OSError):
                conn.close()


class ParallelEnv(BatchedEnvBase):
    """``num_workers`` sub-envs, each in its own worker process, as one batched env.

    The env has batch size ``(num_workers, *sub_batch)`` and rlharvest's array protocol, so
    ``Collector``, the Multi* collectors and nodes run it through their fast path; sub-envs can be
    any env factory (rlharvest envs, ``GymEnv``, TorchRL envs and ``TransformedEnv`` s). Data is
    exactly that of :class:`~rlharvest.envs.SerialEnv` with the same arguments. A sub-env whose step
    ends its episode is reset in the same wake-up, so the rollout's reset of that row is free; a
    sub-env stepped again without that reset starts the new episode.

    Args:
        num_workers: number of sub-envs (one process each).
        create_env_fn: a callable returning an env, or a list of ``num_workers`` of them.
        create_env_kwargs: keyword arguments for ``create_env_fn`` (one dict, or one per sub-env).
        num_sub_threads: torch threads of each sub-env process.
        serial_for_single: with ``num_workers=1``, return a :class:`SerialEnv` instead.
        mp_start_method: ``"fork"`` (default where available), ``"spawn"`` or ``"forkserver"``.
        daemon: start sub-env processes as daemons.
        shutdown_timeout: seconds ``close()`` waits before terminating sub-env processes.
        worker_timeout: seconds a sub-env may take to answer one step or reset.
        **torchrl_options: TorchRL's other batched-env arguments (``shared_memory``, ``use_buffers``,
            ...), accepted where they change nothing and refused by name otherwise.

    Raises:
        WorkerError: when a sub-env fails to build, raises, dies or hangs (``worker_idx`` = the sub-env).
        ValueError: for bad arguments, or sub-envs whose data does not stack.

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import GymEnv, ParallelEnv
        >>> env = ParallelEnv(4, lambda: GymEnv("CartPole-v1"))
        >>> collector = Collector(env, frames_per_batch=64, total_frames=128)
        >>> [tuple(batch.shape) for batch in collector]
        [(4, 16), (4, 16)]
        >>> collector.shutdown()
    """

    def __new__(cls, num_workers: int = 1, *args, serial_for_single: bool = False, **kwargs):
        if serial_for_single and num_workers == 1:
            return SerialEnv(num_workers, *args, **kwargs)
        return super().__new__(cls)

    def _make_pool(self, config: BatchedEnvConfig) -> SubEnvPool:
        pool = ProcessPool(config)
        _LIVE.add(self)
        return pool
