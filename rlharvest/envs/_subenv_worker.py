"""The sub-env side of :class:`~rlharvest.envs.SerialEnv` and :class:`~rlharvest.envs.ParallelEnv`.

A :class:`SubEnvRunner` owns one sub-env and drives it through the env adapter (the array fast path
for rlharvest's envs, the TensorDict protocol for any other env, TorchRL's ``TransformedEnv``
included). It reads its actions from, and writes its outcome into, its row of the batched env's
:class:`Buffers` (shared memory for ParallelEnv), so nothing is pickled per step. ``SerialEnv``
calls its runners directly; ParallelEnv runs one per process with :func:`subenv_main`, which waits
for one command byte per step and answers on a :class:`ReplyBoard` (the last sub-env to answer a
round wakes the parent).

A sub-env whose step ends its episode is reset in the same wake-up (as gymnasium's SAME_STEP
autoreset does): the fresh root goes to the ``root`` buffer and the row's ``pending`` flag tells the
batched env that resetting that row is free. The rollout loop resets every row that ended right
after the step, so this saves a round trip per episode without changing a single value.
"""

from __future__ import annotations

import os
import pickle
import random
import select
from typing import Any, Callable

import numpy as np
import torch

from .._processes import prepare_worker_process
from .._utils import unravel_key, unwrap
from ..errors import RemoteFailure
from ._subenv_protocol import (FLAGS, PAYLOAD_COMMANDS, Buffers, FirstStep, ReplyBoard, Slot, Status, SubEnvCommand,
                               SubEnvDescription, Unavailable, as_tensor, bool_array, slots_of, value_meta)
from .adapters import ArrayEnvAdapter, env_attr, is_env, make_env_adapter
from .capture import capture_env_state, restore_env_state
from .reconfigure import reconfigure_env
from .state import (EnvStateUnavailable, process_generators,
                    restore_process_generators)

__all__ = ["SubEnvRunner", "build_env", "subenv_main"]

def build_env(create_env_fn: Callable, create_env_kwargs: dict | None):
    """Build one sub-env; it must be an env of the protocol.

    Raises:
        TypeError: when ``create_env_fn`` is not callable or returns something that is not an env.
    """
    create_env_fn = unwrap(create_env_fn)
    if is_env(create_env_fn) or not callable(create_env_fn):
        raise TypeError(f"create_env_fn must be a callable returning an env, got {type(create_env_fn).__name__} "
                        "(an env instance cannot be copied into sub-env workers: pass the function that builds it).")
    env = create_env_fn(**(create_env_kwargs or {}))
    if not is_env(env):
        raise TypeError(f"create_env_fn returned {type(env).__name__}, which is not an env.")
    return env


class SubEnvRunner:
    """One sub-env of a batched env, driven through its adapter.

    Args:
        env: the sub-env (any env of the protocol).
        index: its row in the batched env.
        reseed_process: on SEED, also seed this process's global torch/numpy/random generators
            (ParallelEnv workers; never in the caller's process).
    """

    def __init__(self, env, index: int, reseed_process: bool = False) -> None:
        self.env = env
        self.index = index
        self.reseed_process = reseed_process
        self.adapter = make_env_adapter(env)
        self.batch_size = torch.Size(self.adapter.batch_size)
        if isinstance(self.adapter, ArrayEnvAdapter):
            self.reward_key = unravel_key(self.adapter.reward_key)
        else:
            rewards = self.adapter.reward_keys
            if len(rewards) != 1 or any(isinstance(k, tuple) for k in self.adapter.done_keys):
                raise NotImplementedError(
                    f"{type(env).__name__} has reward keys {rewards} and done keys {self.adapter.done_keys}: batched "
                    "envs support one reward key and root-level done flags.")
            self.reward_key = rewards[0]
        self.root = self.adapter.reset(None)
        self.root_keys = [unravel_key(k) for k in self.root if unravel_key(k) not in FLAGS]
        self._closed = False
        # The array adapter derives done from terminated/truncated: its flags can be written as they are.
        self._raw_flags = isinstance(self.adapter, ArrayEnvAdapter)
        self._actions: dict | None = None
        self._root_slots: dict | None = None
        self._next_slots: dict | None = None
        self._handlers = {
            SubEnvCommand.STEP: lambda _: self.step(),
            SubEnvCommand.RESET: lambda _: self.reset(full=True),
            SubEnvCommand.RESET_ROWS: lambda _: self.reset(full=False),
            SubEnvCommand.SEED: lambda payload: self.set_seed(*payload),
            SubEnvCommand.ATTACH: self.attach,
            SubEnvCommand.CLOSE: lambda _: self.close(),
            SubEnvCommand.CAPTURE: lambda _: self.capture(),
            SubEnvCommand.RESTORE: self.restore,
            SubEnvCommand.RECONFIGURE: lambda op: reconfigure_env(self.env, op),
        }

    # ------------------------------------------------------------------ setup
    def describe(self) -> SubEnvDescription:
        env = self.env
        actions = env.full_action_spec
        action_keys = env_attr(env, "action_keys") or list(actions.keys(True, True))
        action_specs = {unravel_key(k): actions[k] for k in action_keys}
        obs_spec = env_attr(env, "observation_spec")
        declared = {unravel_key(k) for k in obs_spec.keys(True, True)} if obs_spec is not None else set()
        return SubEnvDescription(
            batch_size=self.batch_size,
            root_layout={k: value_meta(self.root[k], k) for k in self.root_keys},
            action_layout={k: (tuple(s.shape), s.dtype) for k, s in action_specs.items()},
            observation_specs={k: obs_spec[k] for k in self.root_keys if k in declared},
            action_specs=action_specs,
            has_truncated=bool(self.adapter.has_truncated),
            reward_key=self.reward_key,
            name=repr(env)[:200],
        )

    def attach(self, buffers: Buffers) -> None:
        """Take views of this sub-env's rows; publish the current root (its reset values) there."""
        index = self.index
        self._actions = {key: tensor[index] for key, tensor in buffers.actions.items()}
        self._root_slots = slots_of(buffers.root, index)
        self._pending = buffers.pending[index].numpy()
        self._reset_mask = buffers.reset_mask[index].numpy()
        if buffers.next is not None:
            self._next_slots = slots_of(buffers.next, index)
            self._reward = Slot(buffers.reward[index])
            self._terminated = Slot(buffers.terminated[index])
            self._truncated = Slot(buffers.truncated[index]) if buffers.truncated is not None else None
        self._publish_root()

    def handle(self, command: SubEnvCommand, payload: Any = None) -> Any:
        """Run one command; returns its result (None for most)."""
        return self._handlers[command](payload)

    # ------------------------------------------------------------------ commands
    def step(self) -> FirstStep | None:
        """One step of the sub-env with the actions of its row; resets it when the step ended it."""
        actions = {key: view.clone() for key, view in self._actions.items()}  # the env may keep them
        root = self.root
        outcome = self.adapter.step(root, actions)
        nxt = outcome.next
        if self._next_slots is None:
            first = self._first_step(nxt, root)
        else:
            first = None
            for key, slot in self._next_slots.items():
                value = nxt.get(key)
                slot.write(root[key] if value is None else value)  # None: carried over from the root
            self._reward.write(nxt[self.reward_key])
            if self._raw_flags:
                self._terminated.write(nxt["terminated"])
                if self._truncated is not None:
                    self._truncated.write(nxt["truncated"])
            else:
                terminated, truncated = self._flags(nxt)
                self._terminated.write(terminated)
                if self._truncated is not None:
                    self._truncated.write(truncated)
        self._advance(outcome, root)
        return first

    def _first_step(self, nxt: dict, root: dict) -> FirstStep:
        values = {key: value for key, value in nxt.items() if key not in FLAGS and key != self.reward_key}
        for key in self.root_keys:
            if key not in values:  # carried over from the root by the env (a state entry)
                values[key] = root[key]
        terminated, truncated = self._flags(nxt)
        return FirstStep({k: as_tensor(v, ("next", k)).clone() for k, v in values.items()},
                         as_tensor(nxt[self.reward_key], ("next", self.reward_key)).clone(), terminated, truncated)

    def _flags(self, nxt: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(terminated, truncated)`` of shape ``(*batch, 1)``, with ``done = terminated | truncated``."""
        shape = (*self.batch_size, 1)
        done = bool_array(nxt["done"], shape)  # numpy: ~1 us per operation where torch takes ~3
        terminated = bool_array(nxt["terminated"], shape) if "terminated" in nxt else done
        if not self.adapter.has_truncated:
            return torch.from_numpy(terminated | done), None
        truncated = bool_array(nxt["truncated"], shape)
        # an env that ends without saying terminated or truncated: count it as terminated
        return torch.from_numpy(terminated | (done & ~truncated)), torch.from_numpy(truncated)

    def _advance(self, outcome, root: dict) -> None:
        adapter = self.adapter
        done = adapter.done_rows(outcome.done)
        if not adapter.any_done(done):
            self.root = outcome.next_root if outcome.next_root is not None else adapter.next_root(outcome.next, root)
            return
        if outcome.next_root is not None:  # the env reset what ended itself (step_and_maybe_reset)
            self.root = outcome.next_root
        else:
            self.root = adapter.reset_rows(adapter.next_root(outcome.next, root), done)
        self._publish_root()
        if self.batch_size:
            self._pending[np.asarray(done.cpu() if isinstance(done, torch.Tensor) else done, dtype=bool)] = True
        else:
            self._pending[()] = True

    def reset(self, full: bool) -> None:
        if full or not self.batch_size:
            self.root = self.adapter.reset(None) if full else self.adapter.reset_rows(self.root, True)
        else:
            mask = torch.from_numpy(self._reset_mask.copy())
            self.root = self.adapter.reset_rows(self.root, mask)
        self._publish_root()

    def _publish_root(self) -> None:
        if self._root_slots is not None:
            root = self.root
            for key, slot in self._root_slots.items():
                slot.write(root[key])

    def set_seed(self, seed: int, static_seed: bool) -> int:
        """Seed the sub-env; returns the seed the next sub-env should use."""
        if self.reseed_process:  # sub-envs that draw from the global generators get distinct streams
            seed_process(seed)
        try:
            out = self.env.set_seed(seed, static_seed=static_seed)
        except TypeError:  # an env whose set_seed takes the seed only
            out = self.env.set_seed(seed)
        if out is None:
            n_envs = int(np.prod(self.batch_size)) if self.batch_size else 1
            out = seed if static_seed else seed + n_envs
        return int(out)

    def capture(self) -> bytes | Unavailable:
        """This sub-env's state (docs/checkpoints.md), pickled now: a snapshot that later steps
        cannot change, and one message through the pipe (not one shared-memory file per tensor).

        It holds the env's own state, the root the next step acts on and, in a ParallelEnv process,
        the process's global generators. An env whose state cannot be captured gives an
        :class:`Unavailable` saying why (the batched env names the sub-env).
        """
        try:
            state = {"env": capture_env_state(self.env), "root": self.root}
        except EnvStateUnavailable as err:
            return Unavailable(str(err))
        if self.reseed_process:
            state["generators"] = process_generators()
        try:
            return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # a root entry that pickle cannot write (non-tensor data of some kind)
            return Unavailable(f"its root values cannot be pickled: {type(err).__name__}: {err}")

    def restore(self, captured: bytes) -> Unavailable | None:
        """Continue from what :meth:`capture` returned: the env, its root (published to the root
        buffer), then the process's generators (last: nothing after them draws)."""
        state = pickle.loads(captured)
        try:
            restore_env_state(self.env, state["env"])
        except EnvStateUnavailable as err:
            return Unavailable(str(err))
        self.root = state["root"]
        self._publish_root()
        if self.reseed_process and "generators" in state:
            restore_process_generators(state["generators"])
        return None

    def close(self) -> None:
        env = self.env
        if self._closed or getattr(env, "is_closed", False):
            return
        self._closed = True
        try:
            env.close(raise_if_closed=False)
        except TypeError:
            env.close()


# ---------------------------------------------------------------------------------------------- worker process
def seed_process(seed: int) -> None:
    """Give this process's global generators their own stream (forked workers share their parent's)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


_WAITED_ON = True  # see prepare_worker_process (a switch for the benchmark that measured it)


def subenv_main(index: int, create_env_fn, create_env_kwargs: dict, commands, results, board: ReplyBoard,
                parent_pid: int | None, death_signal: bool, num_threads: int, seed: int) -> None:
    """Entry point of a ParallelEnv sub-env process: build the sub-env, describe it, serve commands.

    ``commands``: command bytes (and pickled payloads) from the parent; ``results``: pickled results
    and failures to it; ``board``: where this sub-env says it answered.
    """
    if not prepare_worker_process(parent_pid, death_signal, waited_on=_WAITED_ON):
        return
    torch.set_num_threads(max(1, int(num_threads)))
    seed_process(seed)
    try:
        runner = SubEnvRunner(build_env(create_env_fn, create_env_kwargs), index, reseed_process=True)
        results.send(runner.describe())
    except BaseException as err:  # reported to the parent, which raises it as a WorkerError
        results.send(RemoteFailure.capture(err, index))
        results.close()
        return
    try:
        _serve(runner, index, commands, results, board, parent_pid)
    finally:
        runner.close()
        commands.close()
        results.close()


def _serve(runner: SubEnvRunner, index: int, commands, results, board: ReplyBoard, parent_pid: int | None) -> None:
    """Answer commands until CLOSE, until the parent's end closes, or until the parent is gone."""
    fd, reply_fd = commands.fileno(), board.reply_w.fileno()
    status, remaining, lock = board.status.numpy(), board.remaining.numpy(), board.lock
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    # command byte -> (command, takes a payload); no Enum lookups on the per-step path
    table = {int(c): (c, c in PAYLOAD_COMMANDS) for c in SubEnvCommand}
    valid = ", ".join(c.name for c in SubEnvCommand)
    while True:
        if not poller.poll(1000):
            if parent_pid is not None and os.getppid() != parent_pid:
                return
            continue
        raw = os.read(fd, 1)
        if not raw:
            return
        command, result, code = None, None, Status.OK
        try:
            entry = table.get(raw[0])
            if entry is None:
                raise ValueError(f"unknown sub-env command {raw[0]}; valid commands: {valid}")
            command, takes_payload = entry
            result = runner.handle(command, commands.recv() if takes_payload else None)
            if result is not None:
                code = Status.PAYLOAD
        except BaseException as err:  # never die silently: the parent raises it, naming this sub-env
            result, code = RemoteFailure.capture(err, index), Status.FAILED
        if result is not None:
            results.send(result)
        status[index] = code
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            os.write(reply_fd, b"\x00")
        if command is SubEnvCommand.CLOSE:
            return
