"""Envs that break their own specs, found within the first batch and named precisely.

The rollout loop never checks values per frame. It calls :func:`check_step_specs` once, on the first
step, when it builds the batch layout (each observation and reward against the env's specs), and
:func:`raise_if_changed` only when stacking a batch failed: that is how a value whose shape or dtype
changed mid-episode shows up, and the error then says which key changed at which step. (A dtype
change is caught when it lasts to the end of a batch, or starts one; a value of another dtype in
the middle of a batch only is cast to the first step's dtype.)

Only values that carry a shape and dtype (tensors, numpy arrays) are checked: Python scalars have
neither. Envs without specs (duck-typed envs) are not checked against specs, and specs the env
cannot produce are skipped: a check never breaks an env that collects.

The policy's side is checked once too, on its first action, before the env steps with it
(:func:`check_policy_actions`): an action key it did not write, or an action the env's action spec
cannot hold (float logits for a one-hot spec, which an env would silently argmax), is named there,
with what the policy wrote and the spec, instead of a bare ``KeyError`` from the env or a run that
learns nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._utils import NestedKey, as_tuple_key, unravel_key
from ..errors import ActionKeyError, ActionSpecError
from .adapters import env_attr
from .specs import CompositeLike, SpecLike

__all__ = ["check_step_specs", "check_policy_actions", "raise_if_changed"]


def _meta(value: Any) -> tuple[tuple | None, torch.dtype | None]:
    """(shape, dtype) a value carries; None for what it does not say."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, np.ndarray):
        return value.shape, torch.from_numpy(np.zeros((), dtype=value.dtype)).dtype
    if isinstance(value, np.generic):
        return None, torch.from_numpy(np.zeros((), dtype=value.dtype)).dtype
    return None, None


def _leaf_specs(spec: CompositeLike) -> dict[NestedKey, SpecLike]:
    """``{key: leaf spec}`` of a composite spec (ours or TorchRL's)."""
    return {unravel_key(key): leaf for key, leaf in spec.items(True, True)
            if isinstance(getattr(leaf, "dtype", None), torch.dtype)}


def _env_specs(env: Any) -> dict[NestedKey, tuple[str, Any]]:
    """``{key in the step dicts: (what, leaf spec)}`` for observations (at the root and under
    ``"next"``) and rewards (under ``"next"``); empty for envs without specs."""
    specs: dict[NestedKey, tuple[str, Any]] = {}
    try:
        observations = env_attr(env, "observation_spec")
        for key, leaf in (_leaf_specs(observations) if observations is not None else {}).items():
            specs[key] = specs[unravel_key(("next", key))] = ("observation", leaf)
        rewards = env_attr(env, "full_reward_spec")
        if rewards is None:
            reward = env_attr(env, "reward_spec")
            keys = env_attr(env, "reward_keys") or ["reward"]
            rewards = {keys[0]: reward} if isinstance(getattr(reward, "dtype", None), torch.dtype) else None
            rewards = {unravel_key(k): v for k, v in rewards.items()} if rewards else None
        else:
            rewards = _leaf_specs(rewards)
        for key, leaf in (rewards or {}).items():
            specs[unravel_key(("next", key))] = ("reward", leaf)
    except Exception:  # an env whose specs cannot be read still collects; it just is not checked
        return {}
    return specs


def _shape_matches(expected: tuple, actual: tuple) -> bool:
    return len(expected) == len(actual) and all(e == a or e == -1 for e, a in zip(expected, actual))


def check_step_specs(env: Any, root: dict, nxt: dict) -> None:
    """Compare a step's observations and rewards with the env's specs.

    Args:
        env: the env (its ``observation_spec`` and reward spec, when it has them).
        root: the step's root values (observations before acting).
        nxt: the step's ``"next"`` values.

    Raises:
        ValueError: naming the key, the spec's shape and dtype and the value's.
    """
    specs = _env_specs(env)
    if not specs:
        return
    values = {unravel_key(key): value for key, value in root.items()}
    values.update({unravel_key(("next", key)): value for key, value in nxt.items()})
    for key, value in values.items():
        entry = specs.get(key)
        if entry is None:
            continue
        what, spec = entry
        shape, dtype = _meta(value)
        expected = tuple(spec.shape)
        if (shape is not None and not _shape_matches(expected, shape)) or (dtype is not None and dtype != spec.dtype):
            raise ValueError(
                f"the env's {what} {key!r} does not match its spec: the spec says shape {expected} and dtype "
                f"{spec.dtype}, the env produced shape {shape if shape is not None else '(scalar)'} and dtype "
                f"{dtype} ({type(env).__name__})."
            )


def raise_if_changed(key: NestedKey, values: list, shape: tuple, dtype: torch.dtype, error: Exception) -> None:
    """Called when stacking a batch's values of ``key`` failed with ``error``: raise a ValueError
    naming the first step whose value's shape or dtype differs from the first step's, if any.

    Raises:
        ValueError: for a changed shape or dtype (chained to ``error``).
    """
    for step, value in enumerate(values):
        actual_shape, actual_dtype = _meta(value)
        changed_shape = actual_shape is not None and tuple(actual_shape) != tuple(shape)
        if changed_shape or (actual_dtype is not None and actual_dtype != dtype):
            raise ValueError(
                f"the env's {key!r} changed at step {step} of this batch: it was shape {tuple(shape)} and dtype "
                f"{dtype} (at the first step), now shape {actual_shape} and dtype {actual_dtype}. Shapes and "
                "dtypes must stay the same within an episode."
            ) from error


# ---------------------------------------------------------------------------------------------- actions
def describe_spec(spec: SpecLike) -> str:
    """``OneHot(shape=(2,), dtype=torch.int64)``: a leaf spec in one line (TorchRL's repr takes many)."""
    n = getattr(spec, "n", None)
    extra = f", n={n}" if isinstance(n, int) else ""
    return f"{type(spec).__name__}(shape={tuple(spec.shape)}, dtype={spec.dtype}{extra})"


def _describe_value(value: Any) -> str:
    shape, dtype = _meta(value)
    if shape is None and dtype is None:
        return type(value).__name__
    return f"shape {shape if shape is not None else '(scalar)'}, dtype {dtype}"


def _written(actions: dict, key: NestedKey) -> bool:
    """Whether ``actions`` holds ``key``, itself or inside an entry kept whole (a sub-TensorDict)."""
    path = as_tuple_key(key)
    for written in actions:
        prefix = as_tuple_key(written)
        if prefix == path or (len(prefix) < len(path) and path[:len(prefix)] == prefix):
            return True
    return False


def _misfit(spec: SpecLike, value: torch.Tensor) -> str | None:
    """Why ``value`` cannot be an action of ``spec`` (None if it can): another number of values, or
    values its dtype cannot hold. Lenient on purpose: another dtype of the same kind, or floats that
    are whole numbers (a one-hot sample of 0. and 1., as TorchRL's ``OneHotCategorical`` draws it),
    are actions an env takes; values are not checked against the spec's bounds."""
    expected = tuple(spec.shape)
    if -1 not in expected and int(np.prod(expected)) != value.numel():
        return f"it holds {value.numel()} values where the spec holds {int(np.prod(expected))}"
    discrete = not (spec.dtype.is_floating_point or spec.dtype.is_complex)
    if discrete and value.dtype.is_floating_point and not bool((value == value.round()).all()):
        return f"its values are not whole numbers (logits?), and a {type(spec).__name__} spec holds {spec.dtype}"
    return None


def check_policy_actions(env: Any, actions: dict) -> None:
    """Check a policy's first action against the env's action keys and spec, before the env steps.

    Args:
        env: the env (its ``action_keys`` and ``full_action_spec``, when it has them).
        actions: what the policy wrote, ``{key: value}``.

    Raises:
        ActionKeyError: naming the missing key, the keys the policy wrote and the env's action spec.
        ActionSpecError: naming the key, the action's shape and dtype, the spec, and why it cannot fit.
    """
    try:
        spec = env_attr(env, "full_action_spec")
        specs = _leaf_specs(spec) if spec is not None else {}
        keys = [unravel_key(k) for k in (env_attr(env, "action_keys") or specs)]
    except Exception:  # an env whose specs cannot be read still collects; it just is not checked
        return
    for key in keys:
        if not _written(actions, key):
            wrote = ", ".join(repr(k) for k in actions) or "nothing"
            leaf = specs.get(key)
            raise ActionKeyError(
                f"the policy did not write the env's action {key!r}: it wrote {wrote}. The env "
                f"({type(env).__name__}) reads {key!r}" + (f", spec {describe_spec(leaf)}" if leaf is not None else "")
                + ". Make the policy write that key (e.g. TensorDictModule(..., out_keys=[" + repr(key) + "]))."
            )
    for key in keys:
        leaf, value = specs.get(key), actions.get(key)
        if leaf is None or not isinstance(value, torch.Tensor):
            continue
        why = _misfit(leaf, value)
        if why is not None:
            raise ActionSpecError(
                f"the policy's action {key!r} ({_describe_value(value)}) cannot be an action of the env's spec "
                f"{describe_spec(leaf)} ({type(env).__name__}): {why}. A policy over discrete actions must sample "
                "or pick them (e.g. argmax of the logits, or a distribution's sample)."
            )
