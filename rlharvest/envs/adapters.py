"""How the rollout loop talks to an env: one interface, two implementations.

* :class:`ArrayEnvAdapter` drives rlharvest's envs through their array protocol (no TensorDict per
  step; Python scalars for unbatched envs).
* :class:`TensorDictEnvAdapter` drives any object with the TensorDict protocol (docs/envs.md), TorchRL's
  ``EnvBase`` included, using ``step_and_maybe_reset`` when available.

Both exchange *step dicts*: ``{nested_key: value}`` for the root of a step and for its ``"next"``
entries. Done-ness per sub-env is a Python bool for unbatched envs and otherwise a bool tensor whose
leading dims are ``batch_size``: a step's ``done`` may keep the env's trailing flag dim (``(*batch, 1)``:
``any()`` needs no more), and :meth:`EnvAdapter.done_rows` gives the tensor of shape ``batch_size``.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from tensordict import is_non_tensor

from .._utils import NestedKey, as_tuple_key, unravel_key

__all__ = ["StepOutcome", "EnvAdapter", "ArrayEnvAdapter", "TensorDictEnvAdapter", "make_env_adapter", "is_env", "is_env_factory", "env_attr",
           "uses_array_protocol"]

_PROTOCOL_MEMBERS = ("batch_size", "reset", "step", "set_seed", "close", "full_action_spec")
#: what the array fast path would skip: a user's version of any of these must run
_TENSORDICT_ENTRY_POINTS = ("reset", "step", "step_and_maybe_reset")


def _has_static(obj: Any, name: str) -> bool:
    """Whether ``obj`` has ``name``, looked up without running any code of ``obj``.

    ``hasattr`` would run properties and ``__getattr__``: TorchRL's ``ParallelEnv`` raises or starts
    its workers, its ``SerialEnv`` recurses, and batched envs forward the question to their sub-envs.
    """
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True


def env_attr(env: Any, name: str, default: Any = None) -> Any:
    """``getattr(env, name, default)`` for an optional member of the env protocol.

    Only members that exist on the object or its class are read (properties run, ``__getattr__``
    never does): a foreign batched env must not forward the question to its sub-envs.
    """
    return getattr(env, name) if _has_static(env, name) else default


def is_env(obj: Any) -> bool:
    """True when ``obj`` is an env *instance* with the members collectors need (docs/envs.md).

    A class is never an env (it is a factory, even though it has every attribute its instances
    have), nor is a function, a ``functools.partial`` or TorchRL's ``EnvCreator``. The members are
    looked up statically, so no code of a foreign object runs.
    """
    if isinstance(obj, type):
        return False
    return all(_has_static(obj, name) for name in _PROTOCOL_MEMBERS)


def is_env_factory(obj: Any) -> bool:
    """True when ``obj`` builds envs: a class, a function, a ``partial``, an ``EnvCreator``..."""
    return not is_env(obj) and callable(obj)


def uses_array_protocol(env: Any) -> bool:
    """Whether the rollout may drive ``env`` through rlharvest's array protocol (the fast path).

    Decided from the env's *type*: it must be one of rlharvest's envs, and neither a user subclass
    nor the instance itself may redefine ``reset``, ``step`` or ``step_and_maybe_reset`` (the array
    protocol would silently skip that code). Subclasses that implement the array methods
    themselves stay on the fast path.
    """
    from .base import EnvBase

    if not isinstance(env, EnvBase):
        return False
    instance_attrs = getattr(env, "__dict__", {})
    if any(name in instance_attrs for name in _TENSORDICT_ENTRY_POINTS):
        return False
    for cls in type(env).__mro__:
        if cls is EnvBase:
            break
        if cls.__module__.split(".")[0] == "rlharvest":
            continue
        if any(name in vars(cls) for name in _TENSORDICT_ENTRY_POINTS):
            return False
    return True


class StepOutcome(NamedTuple):
    next: dict
    done: Any
    next_root: dict | None


def _any(done) -> bool:
    return bool(done) if isinstance(done, bool) else bool(done.any())


class EnvAdapter:
    """The operations the rollout loop needs from an env."""

    env: Any
    batch_size: torch.Size
    #: root done-flag keys that are always False under auto-reset and are filled in at assembly
    implicit_root_flags: list[NestedKey] = []
    #: whether the env exposes a ``truncated`` flag at the root of its done keys
    has_truncated: bool
    #: reward entries of ``("next", ...)``, and the observation keys of the env's spec
    reward_keys: list[NestedKey] = ["reward"]
    observation_keys: frozenset = frozenset()
    #: ``(truncated key, done key)`` of every group of done flags (a time limit sets both)
    truncation_keys: list[tuple[NestedKey, NestedKey]] = [("truncated", "done")]

    def reset(self, mask=None) -> dict:
        raise NotImplementedError

    def step(self, root: dict, actions: dict) -> StepOutcome:
        raise NotImplementedError

    def next_root(self, nxt: dict, root: dict) -> dict:
        """The root of the next step when nothing was reset."""
        raise NotImplementedError

    def reset_rows(self, root: dict, mask) -> dict:
        """``root`` with the sub-envs selected by ``mask`` reset (a bool for unbatched envs)."""
        raise NotImplementedError

    def any_done(self, done) -> bool:
        return _any(done)

    def done_rows(self, done):
        """A step's ``done`` as one flag per sub-env (shape ``batch_size``; a bool for one env)."""
        return done


class ArrayEnvAdapter(EnvAdapter):
    """Fast path for envs implementing ``_reset_arrays`` / ``_step_arrays``."""

    def __init__(self, env) -> None:
        self.env = env
        self.batch_size = torch.Size(env.batch_size)
        self.has_truncated = bool(env.has_truncated)
        self.implicit_root_flags = ["done", "terminated"] + (["truncated"] if self.has_truncated else [])
        self.reward_key = env.reward_key
        self.reward_keys = [unravel_key(env.reward_key)]
        self._batched = len(self.batch_size) > 0
        self._rows, self._flag_dims = self.batch_size.numel(), len(self.batch_size) + 1
        self._observation_keys = frozenset(unravel_key(k) for k in env.observation_spec.keys(True, True))
        self.observation_keys = self._observation_keys
        # the usual env observes one key: its next root is built without a loop (~0.4 us a step)
        self._one_key = next(iter(self._observation_keys)) if len(self._observation_keys) == 1 else None

    def reset(self, mask=None) -> dict:
        return dict(self.env._reset_arrays(mask))

    def step(self, root: dict, actions: dict) -> StepOutcome:
        observations, reward, terminated, truncated = self.env._step_arrays(actions)
        nxt = dict(observations)
        nxt[self.reward_key] = reward
        if not self._batched:  # the common case first: Python flags, one env
            terminated = bool(terminated)
            nxt["terminated"] = terminated
            if self.has_truncated:
                truncated = bool(truncated)
                nxt["truncated"] = truncated
                terminated = terminated or truncated
            nxt["done"] = terminated
            return StepOutcome(nxt, terminated, None)
        terminated = _as_tensor(terminated)
        nxt["terminated"] = terminated
        if self.has_truncated:
            truncated = _as_tensor(truncated)
            nxt["truncated"] = truncated
            done = terminated | truncated
        else:
            done = terminated
        nxt["done"] = done
        # the flags as they are (the usual (*batch, 1)): the loop only asks any() of most steps, and the
        # rows of those that ended (done_rows): ~2-3 us a step less than reducing every step's flags
        return StepOutcome(nxt, done, None)

    def done_rows(self, done):
        if not self._batched or done.dim() == len(self.batch_size):
            return done
        if done.dim() == self._flag_dims and done.numel() == self._rows:
            return done.squeeze(-1)  # one flag per row: a view
        return done.reshape(self.batch_size + (-1,)).any(-1)

    def next_root(self, nxt: dict, root: dict) -> dict:
        key = self._one_key
        if key is not None and key in nxt:
            return {key: nxt[key]}
        keys = self._observation_keys
        return {k: v for k, v in nxt.items() if k in keys}

    def reset_rows(self, root: dict, mask) -> dict:
        if not self._batched:
            return self.reset(None) if mask else root
        return self.reset(mask)


def _as_tensor(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.asarray(value))


class TensorDictEnvAdapter(EnvAdapter):
    """General path for any env with the TensorDict protocol (TorchRL's ``EnvBase`` included)."""

    def __init__(self, env) -> None:
        self.env = env
        self.batch_size = torch.Size(env.batch_size)
        self.device = env_attr(env, "device")
        self.done_keys = [unravel_key(k) for k in env_attr(env, "done_keys", ["done"])]
        self.has_truncated = any(as_tuple_key(k)[-1] == "truncated" for k in self.done_keys)
        self.action_keys = [unravel_key(k) for k in env.action_keys]
        self.reward_keys = [unravel_key(k) for k in env_attr(env, "reward_keys", ["reward"])]
        spec = env_attr(env, "observation_spec")
        self.observation_keys = frozenset(unravel_key(k) for k in spec.keys(True, True)) if spec is not None else frozenset()
        self._step_and_reset = env_attr(env, "step_and_maybe_reset")
        self._reset_groups = _reset_groups(self.done_keys)
        self.truncation_keys = [
            (unravel_key((*prefix, "truncated")), done_key)
            for prefix, done_key in _reset_groups([k for k in self.done_keys if as_tuple_key(k)[-1] == "done"])
        ] or [("truncated", "done")]

    def _td(self, values: dict) -> TensorDictBase:
        return TensorDict(values, batch_size=self.batch_size, device=self.device)

    def reset(self, mask=None) -> dict:
        if mask is None:
            return step_leaves(self.env.reset())
        raise RuntimeError("masked resets go through reset_rows")

    def step(self, root: dict, actions: dict) -> StepOutcome:
        td = self._td({**root, **actions})
        if self._step_and_reset is not None:
            stepped, next_root = self._step_and_reset(td)
            nxt = stepped.get("next")
            return StepOutcome(step_leaves(nxt), self._done_rows(nxt), step_leaves(next_root))
        stepped = self.env.step(td)
        nxt = stepped.get("next")
        return StepOutcome(step_leaves(nxt), self._done_rows(nxt), None)

    def next_root(self, nxt: dict, root: dict) -> dict:
        out = {k: v for k, v in root.items() if k not in self.action_keys and k not in self.reward_keys}
        out.update({k: v for k, v in nxt.items() if k not in self.reward_keys})
        return out

    def _done_rows(self, nxt: TensorDictBase):
        batch = self.batch_size
        done = None
        for key in self.done_keys:
            if key in nxt.keys(True, True) and as_tuple_key(key)[-1] == "done":
                rows = nxt.get(key).reshape(*batch, -1).any(-1)
                done = rows if done is None else done | rows
        if done is None:
            done = torch.zeros(batch, dtype=torch.bool)
        return bool(done) if not batch else done

    def reset_rows(self, root: dict, mask) -> dict:
        if not self.batch_size:
            if not mask:
                return root
            mask = torch.ones((), dtype=torch.bool)
        td = self._td(dict(root))
        for prefix, done_key in self._reset_groups:
            shape = td.get(done_key).shape if done_key in td.keys(True, True) else (*self.batch_size, 1)
            rows = torch.as_tensor(mask).reshape(*self.batch_size, *([1] * (len(shape) - len(self.batch_size))))
            td.set((*prefix, "_reset"), rows.expand(shape).clone())
        out = self.env.reset(td)
        values = step_leaves(out)
        return {k: v for k, v in values.items() if as_tuple_key(k)[-1] != "_reset"}


def _reset_groups(done_keys: list[NestedKey]) -> list[tuple[tuple, NestedKey]]:
    groups, seen = [], set()
    for key in done_keys:
        parts = as_tuple_key(key)
        prefix = parts[:-1]
        if prefix not in seen:
            seen.add(prefix)
            groups.append((prefix, unravel_key((*prefix, parts[-1]))))
    return groups


def step_leaves(td: TensorDictBase) -> dict:
    """``{nested key: value}`` of a step: tensors, and whole sub-TensorDicts the rollout must keep
    as they are (see :func:`is_structured`)."""
    out: dict = {}
    batch_dims = td.batch_dims
    stack = [((), td)]
    while stack:
        prefix, node = stack.pop()
        for name, value in node.items():
            key = (*prefix, name)
            if isinstance(value, TensorDictBase) and not is_structured(value, batch_dims):
                stack.append((key, value))
            else:
                out[key[0] if len(key) == 1 else key] = value
    return out


def is_structured(value: Any, batch_dims: int) -> bool:
    """Values the rollout keeps whole instead of splitting into tensors: non-tensor data, lazily
    stacked (heterogeneous) TensorDicts, and sub-TensorDicts with batch dims of their own (e.g. one
    row per agent), whose leaves alone would lose those dims."""
    if not isinstance(value, TensorDictBase):
        return False
    if is_non_tensor(value) or isinstance(value, LazyStackedTensorDict):
        return True
    return value.batch_dims > batch_dims


def make_env_adapter(env) -> EnvAdapter:
    """The adapter for ``env``: the array fast path when the env implements it."""
    if not is_env(env):
        missing = [name for name in _PROTOCOL_MEMBERS if not _has_static(env, name)]
        raise TypeError(f"{type(env).__name__} is not an env: it lacks {missing} (see docs/envs.md).")
    if uses_array_protocol(env):
        return ArrayEnvAdapter(env)
    return TensorDictEnvAdapter(env)
