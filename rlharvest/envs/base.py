"""rlharvest's own environment base class.

Collectors accept *any* object with the members of the env protocol (docs/envs.md), TorchRL's ``EnvBase``
included. rlharvest's envs additionally implement a cheap *array protocol* that the rollout loop
uses as its fast path, so that a step costs a few microseconds of bookkeeping rather than the
construction of TensorDicts:

* ``_reset_arrays(mask)`` returns the observation values of every sub-env after resetting those
  selected by ``mask`` (``None`` = all);
* ``_step_arrays(actions)`` returns ``(observations, reward, terminated, truncated)`` for every
  sub-env, without resetting anything.

Values are tensors, numpy arrays, or (for unbatched envs) Python scalars, which stand for shape
``(1,)``. The TensorDict protocol (``reset``/``step``/``step_and_maybe_reset``/...) is implemented
here once on top of the array protocol, so a subclass only writes the two array methods.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey

from .specs import Binary, Composite, TensorSpec, Unbounded
from .state import instance_state, restore_instance_state

__all__ = ["EnvBase", "to_tensor"]

_PY_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float32}


def to_tensor(value: Any, device: torch.device | None = None) -> torch.Tensor:
    """Convert an array-protocol value to a tensor (Python scalars become shape ``(1,)``)."""
    if isinstance(value, torch.Tensor):
        tensor = value
    elif isinstance(value, np.ndarray):
        tensor = torch.from_numpy(value)
    elif isinstance(value, np.generic):
        tensor = torch.from_numpy(np.asarray(value).reshape(1))
    else:
        tensor = torch.tensor([value], dtype=_PY_DTYPES.get(type(value)))
    return tensor.to(device) if device is not None and tensor.device != device else tensor


class EnvBase:
    """Base class of rlharvest's envs: specs, the array protocol, and the TensorDict protocol on top.

    Subclasses set ``batch_size``, ``observation_spec`` (a :class:`Composite` of per-step
    observations), ``full_action_spec``, and ``has_truncated``, and implement ``_reset_arrays``,
    ``_step_arrays`` and ``_set_seed``.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> env = CountingEnv(max_steps=3)
        >>> td = env.reset()
        >>> td["action"] = torch.ones(1, dtype=torch.int64)
        >>> env.step(td)["next", "observation"]
        tensor([1], dtype=torch.int32)
    """

    batch_size: torch.Size = torch.Size([])
    device: torch.device | None = torch.device("cpu")
    observation_spec: Composite
    full_action_spec: Composite
    has_truncated: bool = True
    reward_key: str = "reward"
    #: whether ``reset`` can reset some sub-envs of the batch and leave the others as they are (a
    #: ``"_reset"`` mask); a collector's ``max_frames_per_traj`` needs it
    partial_reset: bool = True
    _has_dynamic_specs = False

    def __init__(self) -> None:
        self.is_closed = False

    # ------------------------------------------------------------------ array protocol
    def _reset_arrays(self, mask: torch.Tensor | None = None) -> dict[NestedKey, Any]:
        raise NotImplementedError

    def _step_arrays(self, actions: dict[NestedKey, torch.Tensor]) -> tuple[dict, Any, Any, Any]:
        raise NotImplementedError

    def _set_seed(self, seed: int) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ specs and keys
    @property
    def reward_spec(self) -> TensorSpec:
        return Unbounded((*self.batch_size, 1), dtype=torch.float32, device=self.device)

    @property
    def done_spec(self) -> Composite:
        flags = ["done", "terminated"] + (["truncated"] if self.has_truncated else [])
        leaf = Binary(shape=(*self.batch_size, 1), dtype=torch.bool, device=self.device)
        return Composite({name: leaf for name in flags}, shape=self.batch_size)

    @property
    def action_spec(self) -> TensorSpec:
        return self.full_action_spec[self.action_keys[0]]

    @property
    def action_keys(self) -> list[NestedKey]:
        return list(self.full_action_spec.keys(True, True))

    @property
    def done_keys(self) -> list[NestedKey]:
        return list(self.done_spec.keys(True, True))

    @property
    def reward_keys(self) -> list[NestedKey]:
        return [self.reward_key]

    @property
    def observation_keys(self) -> list[NestedKey]:
        return list(self.observation_spec.keys(True, True))

    # ------------------------------------------------------------------ TensorDict protocol
    def _flags(self, terminated, truncated) -> dict[str, torch.Tensor]:
        term = to_tensor(terminated, self.device).bool().reshape(*self.batch_size, 1)
        flags = {"terminated": term}
        if self.has_truncated:
            trunc = to_tensor(truncated, self.device).bool().reshape(*self.batch_size, 1)
            flags["truncated"] = trunc
            flags["done"] = term | trunc
        else:
            flags["done"] = term.clone()
        return flags

    def _root_td(self, observations: dict) -> TensorDict:
        data = {k: to_tensor(v, self.device) for k, v in observations.items()}
        false = torch.zeros((*self.batch_size, 1), dtype=torch.bool, device=self.device)
        for flag in self.done_keys:
            data[flag] = false.clone()
        return TensorDict(data, batch_size=self.batch_size, device=self.device)

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        """Reset all sub-envs, or those flagged by a boolean ``"_reset"`` entry of ``tensordict``."""
        mask = None
        if tensordict is not None and "_reset" in tensordict.keys():
            mask = tensordict.get("_reset").reshape(*self.batch_size, -1).any(-1)
            if not self.batch_size:
                mask = None if bool(mask) else False
        if mask is False:
            return tensordict.exclude("_reset")
        observations = self._reset_arrays(mask)
        out = self._root_td(observations)
        if tensordict is not None and mask is not None:
            # Rows that were not reset keep their flags; every other entry is carried over.
            row_mask = mask.reshape(*self.batch_size, 1)
            for flag in self.done_keys:
                if flag in tensordict.keys():
                    out.set(flag, tensordict.get(flag) & ~row_mask)
            out.update(tensordict.exclude("_reset", *out.keys()))
        return out

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Read the actions from ``tensordict``, write the outcome under ``"next"``."""
        actions = {key: tensordict.get(key) for key in self.action_keys}
        observations, reward, terminated, truncated = self._step_arrays(actions)
        nxt = {k: to_tensor(v, self.device).clone() for k, v in observations.items()}
        nxt[self.reward_key] = to_tensor(reward, self.device).float().reshape(*self.batch_size, 1)
        nxt.update(self._flags(terminated, truncated))
        tensordict.set("next", TensorDict(nxt, batch_size=self.batch_size, device=self.device))
        return tensordict

    def step_and_maybe_reset(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """``step``, then a root for the next step in which done sub-envs have been reset."""
        stepped = self.step(tensordict)
        next_root = stepped.get("next").exclude(self.reward_key)
        carried = stepped.exclude("next", self.reward_key, *self.action_keys, *next_root.keys())
        next_root.update(carried)
        done = next_root.get("done").reshape(*self.batch_size, -1).any(-1)
        if done.any():
            reset_td = next_root.clone()
            reset_td.set("_reset", next_root.get("done").clone())
            next_root = self.reset(reset_td)
        return stepped, next_root

    def rand_action(self, tensordict: TensorDictBase | None = None) -> TensorDictBase:
        """Write a uniformly random action into ``tensordict`` (a new one if ``None``)."""
        if tensordict is None:
            tensordict = TensorDict({}, batch_size=self.batch_size, device=self.device)
        for key, spec in self.full_action_spec.items(True, True):
            tensordict.set(key, spec.rand())
        return tensordict

    def set_seed(self, seed: int | None = None, static_seed: bool = False) -> int | None:
        """Seed the env; returns the seed the next env should use."""
        if seed is None:
            return None
        self._set_seed(int(seed))
        n_envs = int(np.prod(self.batch_size)) if self.batch_size else 1
        return int(seed) if static_seed else int(seed) + n_envs

    def fake_tensordict(self) -> TensorDictBase:
        """A zero TensorDict holding every key of one transition."""
        td = self.observation_spec.zero()
        td.update(self.done_spec.zero())
        td.update(self.full_action_spec.zero())
        nxt = self.observation_spec.zero()
        nxt.update(self.done_spec.zero())
        nxt.set(self.reward_key, self.reward_spec.zero())
        td.set("next", nxt)
        return td

    def rollout(
        self,
        max_steps: int,
        policy: Callable | None = None,
        callback: Callable | None = None,
        *,
        auto_reset: bool = True,
        break_when_any_done: bool | None = None,
        break_when_all_done: bool | None = None,
        tensordict: TensorDictBase | None = None,
        set_truncated: bool = False,
    ) -> TensorDictBase:
        """Up to ``max_steps`` steps, stacked along a last dim named ``"time"`` (for debugging and
        evaluation; collectors use the rollout loop instead).

        Args:
            max_steps: number of steps.
            policy: TensorDict -> TensorDict callable writing the action; random actions if None.
            callback: called as ``callback(env, tensordict)`` after every step.
            auto_reset: reset before the first step; with False, ``tensordict`` is the first state.
            break_when_any_done: stop after the first step in which a sub-env is done (the default
                when neither break flag is given); with False, finished sub-envs are reset and the
                rollout goes on.
            break_when_all_done: stop once every sub-env is done.
            tensordict: the starting state (required when ``auto_reset=False``).
            set_truncated: mark the last step as truncated (and done).

        Raises:
            RuntimeError: when ``auto_reset=False`` without a ``tensordict``, or when both break
                flags are True.

        Example:
            >>> import torch
            >>> from rlharvest.envs import CountingEnv
            >>> step_up = lambda td: td.set("action", torch.ones(1, dtype=torch.int8))
            >>> CountingEnv(max_steps=2).rollout(10, step_up).batch_size  # stops at the episode's end
            torch.Size([3])
        """
        if break_when_any_done and break_when_all_done:
            raise RuntimeError("break_when_any_done and break_when_all_done cannot both be True.")
        if break_when_any_done is None:
            break_when_any_done = not break_when_all_done
        if auto_reset:
            td = self.reset(tensordict)
        elif tensordict is None:
            raise RuntimeError("rollout(auto_reset=False) needs the starting state as tensordict=.")
        else:
            td = tensordict
        steps = []
        for index in range(max_steps):
            td = policy(td) if policy is not None else self.rand_action(td)
            td, next_root = self.step_and_maybe_reset(td)
            if set_truncated and index == max_steps - 1 and self.has_truncated:
                td.set(("next", "truncated"), torch.ones_like(td.get(("next", "truncated"))))
                td.set(("next", "done"), torch.ones_like(td.get(("next", "done"))))
            if callback is not None:
                callback(self, td)
            steps.append(td)
            done = td.get(("next", "done"))
            if (break_when_any_done and done.any()) or (break_when_all_done and done.all()):
                break
            td = next_root
        out = torch.stack(steps, dim=len(self.batch_size))
        out.refine_names(*([None] * len(self.batch_size)), "time")
        return out

    def capture_state(self) -> dict[str, Any]:
        """This env's own state, for an exact resume (docs/checkpoints.md): a deep copy of its
        instance attributes, specs excepted. Override to capture less, or what lives elsewhere.

        Raises:
            EnvStateUnavailable: when the state cannot be captured (an attribute cannot be copied).

        Example:
            >>> from rlharvest.envs import CountingEnv
            >>> env = CountingEnv()
            >>> state = env.capture_state()
            >>> _ = env.reset(); env.restore_state(state)
        """
        return instance_state(self)

    def restore_state(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`capture_state` returned (the env continues from there)."""
        restore_instance_state(self, state)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        return None

    def to(self, device) -> EnvBase:
        if device is not None and torch.device(device).type != "cpu":
            raise NotImplementedError(f"{type(self).__name__} runs on the CPU only.")
        return self

    def close(self, *, raise_if_closed: bool = True) -> None:
        if self.is_closed and raise_if_closed:
            raise RuntimeError(f"{type(self).__name__} is already closed.")
        self.is_closed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_size={tuple(self.batch_size)})"
