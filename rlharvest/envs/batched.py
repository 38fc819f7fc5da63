"""Batched envs: ``num_workers`` sub-envs stepped as one env of batch ``(num_workers, *sub_batch)``.

:class:`SerialEnv` steps its sub-envs in this process; :class:`~rlharvest.envs.ParallelEnv` steps
each in a worker process. Both are this module's :class:`BatchedEnvBase`: one implementation of the
array protocol over preallocated buffers (one per key, leading dim = sub-env), and a
:class:`SubEnvPool` that says where the sub-envs run. So both give exactly the same data, and the
rollout loop drives either through its array fast path.

Layouts are discovered from the sub-envs themselves (no env is built in this process for
ParallelEnv): the root from the reset every sub-env does when it starts, the outcome of a step from
the first step. Sub-envs must agree on keys, shapes and dtypes.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .._utils import NestedKey, positive_int, positive_seconds
from ._subenv_protocol import Buffers, FirstStep, SubEnvCommand, SubEnvDescription, Unavailable
from ._subenv_worker import SubEnvRunner, build_env
from .base import EnvBase
from .reconfigure import EnvOp
from .specs import Composite, SpecLike, TensorSpec, Unbounded
from .state import EnvStateUnavailable

__all__ = ["BatchedEnvConfig", "BatchedEnvBase", "SerialEnv", "SubEnvPool"]

#: seconds a sub-env may take to answer one command before WorkerTimeoutError
DEFAULT_SUBENV_TIMEOUT = 120.0
_ENV_IDS = itertools.count()


@dataclass(frozen=True)
class BatchedEnvConfig:
    """The arguments of a batched env, validated once."""

    num_workers: int
    """Number of sub-envs (one worker process each for ParallelEnv)."""
    create_env_fns: tuple
    """One env constructor per sub-env."""
    create_env_kwargs: tuple
    """One dict of keyword arguments per sub-env."""
    num_sub_threads: int = 1
    """torch threads of each sub-env process."""
    mp_start_method: str | None = None
    """``fork`` (default where available), ``spawn`` or ``forkserver``."""
    daemon: bool = False
    """Start sub-env processes as daemons (they then cannot start processes of their own)."""
    shutdown_timeout: float = 10.0
    """Seconds ``close()`` waits for sub-envs to close before terminating them."""
    worker_timeout: float = DEFAULT_SUBENV_TIMEOUT
    """Seconds a sub-env may take to answer one command (a step, a reset) before WorkerTimeoutError."""
    env_id: int = 0
    """Distinguishes the global-generator seeds of this env's sub-env processes from other envs'."""


#: TorchRL batched-env arguments rlharvest accepts only with these values, and why
_NEUTRAL_ONLY = {
    "pin_memory": ((False,), "pinned outputs are deprecated in TorchRL too"),
    "share_individual_td": ((None, False), "sub-envs' data is always stacked into one TensorDict"),
    "memmap": ((False,), "outputs are private tensors, never memory-mapped"),
    "policy_proof": ((None,), "keys to carry are found from the sub-envs' own outputs"),
    "allow_step_when_done": ((False,), "deprecated in TorchRL; done sub-envs are reset by the rollout"),
}


def batched_env_config(owner: str, num_workers: int, create_env_fn, create_env_kwargs, *, device=None,
                       num_sub_threads: int = 1, mp_start_method: str | None = None, daemon: bool = False,
                       shutdown_timeout: float = 10.0, worker_timeout: float = DEFAULT_SUBENV_TIMEOUT,
                       **torchrl_options) -> BatchedEnvConfig:
    """Validate a batched env's arguments.

    Raises:
        ValueError: naming the argument, for a bad value or an unsupported TorchRL option.
    """
    num_workers = positive_int("num_workers", num_workers)
    for name, value in torchrl_options.items():
        allowed, why = _NEUTRAL_ONLY[name]
        if not any(value is a or value == a for a in allowed):
            raise ValueError(f"{owner}: {name}={value!r} is not supported ({why}); allowed: {list(allowed)}.")
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"{owner}: device={device!r} is not supported; batched envs run on the CPU.")
    if isinstance(create_env_fn, (list, tuple)):
        if len(create_env_fn) != num_workers:
            raise ValueError(f"{owner}: create_env_fn has {len(create_env_fn)} entries for num_workers={num_workers}.")
        fns = tuple(create_env_fn)
    else:
        fns = (create_env_fn,) * num_workers
    if create_env_kwargs is None or isinstance(create_env_kwargs, dict):
        kwargs = tuple(dict(create_env_kwargs or {}) for _ in range(num_workers))
    elif len(create_env_kwargs) != num_workers or not all(isinstance(k, dict) for k in create_env_kwargs):
        raise ValueError(f"{owner}: create_env_kwargs must be a dict or a list of {num_workers} dicts.")
    else:
        kwargs = tuple(dict(k) for k in create_env_kwargs)
    return BatchedEnvConfig(
        num_workers=num_workers, create_env_fns=fns, create_env_kwargs=kwargs,
        num_sub_threads=positive_int("num_sub_threads", num_sub_threads), mp_start_method=mp_start_method,
        daemon=bool(daemon), shutdown_timeout=positive_seconds("shutdown_timeout", shutdown_timeout),
        worker_timeout=positive_seconds("worker_timeout", worker_timeout), env_id=next(_ENV_IDS),
    )


class SubEnvPool(ABC):
    """Where a batched env's sub-envs run: this process (SerialEnv) or worker processes (ParallelEnv)."""

    #: whether the buffers must live in shared memory
    shared: bool = False

    @abstractmethod
    def start(self) -> list[SubEnvDescription]:
        """Build every sub-env; returns their descriptions, in sub-env order."""

    @abstractmethod
    def run(self, command: SubEnvCommand, workers: Sequence[int], payload: Any = None) -> dict[int, Any]:
        """Run ``command`` on ``workers`` and wait for all of them; returns the results that are not None.

        Raises:
            WorkerError: when a sub-env raised, died, or did not answer in time.
        """

    @abstractmethod
    def close(self, timeout: float) -> None:
        """Close every sub-env and release what the pool holds, within ``timeout`` seconds."""


class InProcessPool(SubEnvPool):
    """Sub-envs stepped one after the other in this process (exceptions propagate as they are)."""

    def __init__(self, config: BatchedEnvConfig) -> None:
        self.config = config
        self.runners: list[SubEnvRunner] = []

    def start(self) -> list[SubEnvDescription]:
        for index, (fn, kwargs) in enumerate(zip(self.config.create_env_fns, self.config.create_env_kwargs)):
            self.runners.append(SubEnvRunner(build_env(fn, kwargs), index))
        return [runner.describe() for runner in self.runners]

    def run(self, command: SubEnvCommand, workers: Sequence[int], payload: Any = None) -> dict[int, Any]:
        results = {}
        for worker in workers:
            result = self.runners[worker].handle(command, payload)
            if result is not None:
                results[worker] = result
        return results

    def close(self, timeout: float) -> None:
        for runner in self.runners:
            runner.close()


class _StackedSpec(TensorSpec):
    """A foreign leaf spec (TorchRL's, say) seen with leading batch dims: samples are the inner spec's."""

    def __init__(self, inner, batch: tuple) -> None:
        super().__init__((*batch, *inner.shape), inner.dtype, getattr(inner, "device", None))
        self.inner, self.batch = inner, tuple(batch)

    def rand(self, shape=None) -> torch.Tensor:
        return self.inner.rand((*torch.Size(shape or ()), *self.batch))

    def zero(self, shape=None) -> torch.Tensor:
        return self.inner.zero((*torch.Size(shape or ()), *self.batch))

    def expand(self, *batch) -> _StackedSpec:
        return _StackedSpec(self.inner, (*batch, *self.batch))


def _stacked(spec: SpecLike, num_workers: int, layout: tuple | None = None) -> TensorSpec | _StackedSpec:
    """The spec of ``num_workers`` stacked sub-envs' values of ``spec`` (rlharvest's kept by type)."""
    if layout is not None and (tuple(spec.shape), spec.dtype) != layout:
        return Unbounded((num_workers, *layout[0]), dtype=layout[1])  # the declared spec disagrees with the data
    if isinstance(spec, TensorSpec):
        return spec.expand(num_workers)
    return _StackedSpec(spec, (num_workers,))


class BatchedEnvBase(EnvBase):
    """``num_workers`` sub-envs as one env of batch ``(num_workers, *sub_batch)`` (see the module doc).

    Subclasses say where sub-envs run (``_make_pool``). The constructor takes TorchRL's batched-env
    arguments; those that cannot apply are accepted only with their neutral value.
    """

    _pool_owner = "BatchedEnv"
    #: the shared step buffers, made once the sub-envs have started
    _buffers: Any = None

    def __init__(
        self,
        num_workers: int,
        create_env_fn: Callable | Sequence[Callable],
        *,
        create_env_kwargs: dict | Sequence[dict] | None = None,
        pin_memory: bool = False,
        share_individual_td: bool | None = None,
        shared_memory: bool = True,
        memmap: bool = False,
        policy_proof: Callable | None = None,
        device=None,
        allow_step_when_done: bool = False,
        num_threads: int | None = None,
        num_sub_threads: int = 1,
        serial_for_single: bool = False,
        non_blocking: bool = False,
        mp_start_method: str | None = None,
        use_buffers: bool | None = None,
        metadata_from_workers: bool = False,
        consolidate: bool = True,
        daemon: bool = False,
        shutdown_timeout: float = 10.0,
        auto_wrap_envs: bool = True,
        worker_timeout: float = DEFAULT_SUBENV_TIMEOUT,
    ) -> None:
        super().__init__()
        self.is_closed = True  # until started
        # shared_memory, non_blocking, use_buffers, metadata_from_workers, consolidate, auto_wrap_envs:
        # accepted with any value; buffers are always used and layouts always come from the sub-envs.
        self.config = batched_env_config(
            type(self).__name__, num_workers, create_env_fn, create_env_kwargs, device=device,
            num_sub_threads=num_sub_threads, mp_start_method=mp_start_method, daemon=daemon,
            shutdown_timeout=shutdown_timeout, worker_timeout=worker_timeout, pin_memory=pin_memory,
            share_individual_td=share_individual_td, memmap=memmap, policy_proof=policy_proof,
            allow_step_when_done=allow_step_when_done,
        )
        if num_threads is not None:
            torch.set_num_threads(positive_int("num_threads", num_threads))
        self.num_workers = self.config.num_workers
        self._pool = self._make_pool(self.config)
        try:
            self._start()
        except BaseException:
            self._pool.close(self.config.shutdown_timeout)
            raise
        self.is_closed = False

    def _make_pool(self, config: BatchedEnvConfig) -> SubEnvPool:
        raise NotImplementedError

    # ------------------------------------------------------------------ start
    def _start(self) -> None:
        descriptions = self._pool.start()
        first = descriptions[0]
        for index, other in enumerate(descriptions[1:], 1):
            if other.signature() != first.signature():
                raise ValueError(
                    f"sub-env {index} ({other.name}) does not stack with sub-env 0 ({first.name}): layouts "
                    f"{other.signature()} and {first.signature()} differ (keys, shapes and dtypes must agree).")
        workers = self.num_workers
        self.description = first
        self._sub_env_names = [description.name for description in descriptions]
        self.sub_batch_size = torch.Size(first.batch_size)
        self.batch_size = torch.Size([workers, *self.sub_batch_size])
        self.has_truncated = first.has_truncated
        self.reward_key = first.reward_key
        self.observation_spec = Composite({
            key: _stacked(first.observation_specs[key], workers, meta) if key in first.observation_specs
            else Unbounded((workers, *meta[0]), dtype=meta[1])
            for key, meta in first.root_layout.items()}, shape=self.batch_size)
        self.full_action_spec = Composite({
            key: _stacked(spec, workers) for key, spec in first.action_specs.items()}, shape=self.batch_size)
        self._buffers = Buffers(
            actions=self._allocate(first.action_layout), root=self._allocate(first.root_layout),
            pending=self._zeros(self.batch_size, torch.bool).fill_(True),
            reset_mask=self._zeros(self.batch_size, torch.bool))
        self._pending_rows = self._buffers.pending.numpy()
        self._root: dict | None = None
        self._everyone = list(range(workers))
        self._pool.run(SubEnvCommand.ATTACH, self._everyone, self._buffers)

    def _zeros(self, shape, dtype) -> torch.Tensor:
        tensor = torch.zeros(shape, dtype=dtype)
        return tensor.share_memory_() if self._pool.shared else tensor

    def _allocate(self, layout: dict) -> dict:
        return {key: self._zeros((self.num_workers, *shape), dtype) for key, (shape, dtype) in layout.items()}

    def _adopt_first_step(self, firsts: dict[int, FirstStep]) -> None:
        """Allocate the outcome buffers from the first step's values, fill them, hand them to the sub-envs."""
        layout = firsts[0].layout()
        for index in range(1, self.num_workers):
            if firsts[index].layout() != layout:
                raise ValueError(f"sub-env {index}'s step outcome {firsts[index].layout()} does not stack with "
                                 f"sub-env 0's {layout}.")
        buffers = self._buffers
        buffers.next = self._allocate(layout[0])
        buffers.reward = self._zeros((self.num_workers, *layout[1][0]), layout[1][1])
        flag_shape = (*self.batch_size, 1)
        buffers.terminated = self._zeros(flag_shape, torch.bool)
        buffers.truncated = self._zeros(flag_shape, torch.bool) if self.has_truncated else None
        for index, first in firsts.items():
            for key, value in first.next.items():
                buffers.next[key][index].copy_(value)
            buffers.reward[index].copy_(first.reward)
            buffers.terminated[index].copy_(first.terminated)
            if buffers.truncated is not None:
                buffers.truncated[index].copy_(first.truncated)
        self._pool.run(SubEnvCommand.ATTACH, self._everyone, buffers)

    # ------------------------------------------------------------------ array protocol
    def _reset_arrays(self, mask: torch.Tensor | None = None) -> dict[NestedKey, torch.Tensor]:
        self._check_open()
        buffers, pending = self._buffers, self._pending_rows
        if mask is None or self._root is None:
            if not pending.all():
                self._pool.run(SubEnvCommand.RESET, self._everyone)
            pending[...] = False
            self._root = {key: value.clone() for key, value in buffers.root.items()}
            return self._root
        # numpy for these small masks: a few us where the same torch ops cost ~30
        rows = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask, dtype=bool).reshape(pending.shape)
        needed = rows & ~pending
        if needed.any():
            workers = np.flatnonzero(needed.reshape(self.num_workers, -1).any(-1)).tolist()
            if self.sub_batch_size:
                buffers.reset_mask.numpy()[...] = needed
                self._pool.run(SubEnvCommand.RESET_ROWS, workers)
            else:
                self._pool.run(SubEnvCommand.RESET, workers)
        pending &= ~rows
        selected = torch.from_numpy(rows)
        root = {}
        for key, value in buffers.root.items():
            row_mask = selected.reshape(*selected.shape, *([1] * (value.dim() - selected.dim())))
            root[key] = torch.where(row_mask, value, self._root[key])
        self._root = root
        return root

    def _step_arrays(self, actions: dict) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self._check_open()
        buffers = self._buffers
        for key, buffer in buffers.actions.items():
            if key not in actions:
                raise KeyError(f"{type(self).__name__}.step: the action {key!r} is missing "
                               f"(got {sorted(map(str, actions))}).")
            buffer.copy_(actions[key].reshape(buffer.shape))
        firsts = self._pool.run(SubEnvCommand.STEP, self._everyone)
        if buffers.next is None:
            self._adopt_first_step(firsts)
        observations = {key: value.clone() for key, value in buffers.next.items()}
        self._root = {key: observations[key] for key in buffers.root}
        truncated = buffers.truncated.clone() if buffers.truncated is not None else None
        return observations, buffers.reward.clone(), buffers.terminated.clone(), truncated

    # ------------------------------------------------------------------ the rest of the protocol
    @property
    def reward_spec(self) -> TensorSpec:
        reward = self._buffers.reward if self._buffers is not None else None
        if reward is None:
            return super().reward_spec
        return Unbounded(tuple(reward.shape), dtype=reward.dtype)

    def set_seed(self, seed: int | None = None, static_seed: bool = False) -> int | None:
        """Seed sub-env 0 with ``seed`` and sub-env k with what sub-env k-1 returned; returns the last.

        The seeds take effect at the next reset (as for every env).
        """
        if seed is None:
            return None
        self._check_open()
        seed = int(seed)
        for worker in self._everyone:
            seed = self._pool.run(SubEnvCommand.SEED, [worker], (seed, bool(static_seed)))[worker]
        self._pending_rows[...] = False  # the next reset must be a real one, with the new seeds
        return seed

    def reconfigure_sub_envs(self, op: EnvOp) -> list[Any]:
        """``op`` (an attribute read or set, a method called: ``envs/reconfigure.py``) applied to each
        sub-env where it runs; what each returned, in sub-env order (docs/collection.md,
        "Reconfiguring running envs").

        Raises:
            WorkerError: naming the sub-env where it failed (``ParallelEnv``; ``SerialEnv`` raises the
                sub-env's own error).
        """
        self._check_open()
        answers = self._pool.run(SubEnvCommand.RECONFIGURE, self._everyone, op)
        return [answers.get(worker) for worker in self._everyone]

    # ------------------------------------------------------------------ state (docs/checkpoints.md)
    def capture_state(self) -> dict[str, Any]:
        """Every sub-env's state, asked of it where it runs (its env, the root its next step acts on,
        a ParallelEnv process's global generators), and this env's own between-step bookkeeping:
        the root it returned last and which rows were reset after their last step.

        Raises:
            EnvStateUnavailable: naming the first sub-env whose state cannot be captured, or when the
                env is closed.
        """
        self._check_captured_open()
        answers = self._pool.run(SubEnvCommand.CAPTURE, self._everyone)
        for worker in self._everyone:
            if isinstance(answers[worker], Unavailable):
                raise EnvStateUnavailable(f"its sub-env {worker} ({self._sub_env_names[worker]}) cannot be captured: "
                                          f"{answers[worker].reason}")
        return {"num_workers": self.num_workers, "sub_envs": [answers[worker] for worker in self._everyone],
                "root": None if self._root is None else {key: value.clone() for key, value in self._root.items()},
                "pending": self._pending_rows.copy()}

    def restore_state(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`capture_state` returned, each sub-env where it runs.

        Raises:
            EnvStateUnavailable: for another number of sub-envs, or naming the first sub-env that
                cannot take its state back (then reset the env: sub-envs before it were restored),
                or when the env is closed.
        """
        self._check_captured_open()
        if state["num_workers"] != self.num_workers:
            raise EnvStateUnavailable(f"the checkpoint holds {state['num_workers']} sub-envs, this "
                                      f"{type(self).__name__} has {self.num_workers}")
        for worker, captured in zip(self._everyone, state["sub_envs"]):
            answer = self._pool.run(SubEnvCommand.RESTORE, [worker], captured).get(worker)
            if isinstance(answer, Unavailable):
                raise EnvStateUnavailable(f"its sub-env {worker} ({self._sub_env_names[worker]}) cannot be "
                                          f"restored: {answer.reason}")
        root = state["root"]
        self._root = None if root is None else {key: value.clone() for key, value in root.items()}
        self._pending_rows[...] = state["pending"]

    def _check_captured_open(self) -> None:
        """A closed env has no state to capture or restore: the caller restarts its episodes, saying so."""
        if self.is_closed:
            raise EnvStateUnavailable(f"the {type(self).__name__} is closed (its sub-envs are gone)")

    def _check_open(self) -> None:
        if self.is_closed:
            raise RuntimeError(f"{type(self).__name__} is closed.")

    def close(self, *, raise_if_closed: bool = True) -> None:
        """Close every sub-env (and stop its process); idempotent with ``raise_if_closed=False``."""
        if self.is_closed and raise_if_closed and self._buffers is not None:
            raise RuntimeError(f"{type(self).__name__} is already closed.")
        if not self.is_closed:
            self.is_closed = True
            self._pool.close(self.config.shutdown_timeout)

    def __del__(self) -> None:
        try:
            self.close(raise_if_closed=False)
        except Exception:
            pass

    def __reduce__(self):
        raise TypeError(f"A {type(self).__name__} cannot be pickled (its sub-envs are live objects): pass a "
                        f"function that builds it instead.")

    def __repr__(self) -> str:
        name = getattr(getattr(self, "description", None), "name", "?")
        return (f"{type(self).__name__}(num_workers={self.num_workers}, sub_env={name}, "
                f"batch_size={tuple(self.batch_size)})")


class SerialEnv(BatchedEnvBase):
    """``num_workers`` sub-envs stepped one after the other in this process, as one batched env.

    Same arguments and exactly the same data as :class:`~rlharvest.envs.ParallelEnv` (without the
    processes: exceptions of sub-envs propagate as they are).

    Args:
        num_workers: number of sub-envs.
        create_env_fn: a callable returning an env, or a list of ``num_workers`` of them.
        create_env_kwargs: keyword arguments for ``create_env_fn`` (one dict, or one per sub-env).

    Example:
        >>> from rlharvest.envs import CountingEnv, SerialEnv
        >>> env = SerialEnv(3, CountingEnv)
        >>> env.reset()["observation"].shape
        torch.Size([3, 1])
        >>> env.close()
    """

    def _make_pool(self, config: BatchedEnvConfig) -> SubEnvPool:
        return InProcessPool(config)

