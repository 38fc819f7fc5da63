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
(:func:`check_policy_actions`): an action key it did not write is named there, with the keys the
policy wrote and the spec, instead of a bare ``KeyError`` from the env. An action the env's spec does
not hold (float logits for a one-hot spec, another number of values) is what TorchRL's envs read
anyway, each spec its own way (docs/collection.md, "Policies"), so it is not refused: the first step
is taken with it (:func:`first_step`); if the env cannot take it either, the env's error comes back as
an :class:`ActionSpecError` naming the action and the spec, and otherwise one warning names the spec
and how the action was read.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .._utils import NestedKey, as_tuple_key, unravel_key
from ..errors import ActionKeyError, ActionReadWarning, ActionSpecError
from .adapters import env_attr
from .specs import CompositeLike, SpecLike

__all__ = ["ActionMisfit", "check_step_specs", "check_policy_actions", "first_step", "raise_if_changed"]


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


@dataclass(frozen=True)
class ActionMisfit:
    """A policy's first action that the env's action spec does not hold, and how TorchRL reads it."""

    key: NestedKey
    value: str
    """The action's shape and dtype."""
    spec: str
    """The spec, in one line."""
    env: str
    """The env's type name."""
    why: str
    """What does not fit: another number of values, or values the spec's dtype cannot hold."""
    reading: str
    """What TorchRL's envs make of such an action (and rlharvest's, which read actions the same way)."""

    def warning(self) -> str:
        return (f"the policy's action {self.key!r} ({self.value}) does not fit the env's spec {self.spec} "
                f"({self.env}): {self.why}. Read as TorchRL reads it: {self.reading}. To choose actions, write "
                "actions of the spec (e.g. a one-hot of the logits' argmax, or a distribution's sample).")

    def error(self, err: BaseException) -> str:
        return (f"the policy's action {self.key!r} ({self.value}) cannot be an action of the env's spec "
                f"{self.spec} ({self.env}): {self.why}, and the env failed at its first step with it, as it does "
                f"under TorchRL ({type(err).__name__}: {err}). A policy over discrete actions must sample or pick "
                "them (e.g. argmax of the logits, or a distribution's sample).")


def _is_one_hot(spec: SpecLike) -> bool:
    """rlharvest's or TorchRL's one-hot spec (``OneHot``, ``MultiOneHot``; their old names too)."""
    return "OneHot" in type(spec).__name__


def _reading(spec: SpecLike, value: torch.Tensor) -> str:
    """How TorchRL's envs turn ``value`` into the env's action, for a spec that does not hold it."""
    if _is_one_hot(spec):
        reading = "value.long().argmax(-1), the index of the largest value once truncated to integers"
        if value.is_floating_point() and bool((value.abs() < 1).all()):
            reading += "; every value of the first action lies in (-1, 1): action 0"
        return reading
    if value.is_floating_point() and not (spec.dtype.is_floating_point or spec.dtype.is_complex):
        return "int(value), truncated toward zero, for the one action of an unbatched env; several values as they are"
    return "as it is, handed to the env"


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


def check_policy_actions(env: Any, actions: dict) -> list[ActionMisfit]:
    """Check a policy's first action against the env's action keys and spec, before the env steps.

    Args:
        env: the env (its ``action_keys`` and ``full_action_spec``, when it has them).
        actions: what the policy wrote, ``{key: value}``.

    Returns:
        The actions the spec does not hold: give them to :func:`first_step`.

    Raises:
        ActionKeyError: naming the missing key, the keys the policy wrote and the env's action spec.
    """
    try:
        spec = env_attr(env, "full_action_spec")
        specs = _leaf_specs(spec) if spec is not None else {}
        keys = [unravel_key(k) for k in (env_attr(env, "action_keys") or specs)]
    except Exception:  # an env whose specs cannot be read still collects; it just is not checked
        return []
    for key in keys:
        if not _written(actions, key):
            wrote = ", ".join(repr(k) for k in actions) or "nothing"
            leaf = specs.get(key)
            raise ActionKeyError(
                f"the policy did not write the env's action {key!r}: it wrote {wrote}. The env "
                f"({type(env).__name__}) reads {key!r}" + (f", spec {describe_spec(leaf)}" if leaf is not None else "")
                + ". Make the policy write that key (e.g. TensorDictModule(..., out_keys=[" + repr(key) + "]))."
            )
    misfits = []
    for key in keys:
        leaf, value = specs.get(key), actions.get(key)
        if leaf is None or not isinstance(value, torch.Tensor):
            continue
        why = _misfit(leaf, value)
        if why is not None:
            misfits.append(ActionMisfit(key, _describe_value(value), describe_spec(leaf), type(env).__name__, why,
                                        _reading(leaf, value)))
    return misfits


def first_step(step: Callable, misfits: list[ActionMisfit], *args: Any) -> Any:
    """``step(*args)``: the env's first step with actions that do not fit its spec (``misfits``).

    Raises:
        ActionSpecError: when the env fails at that step (its error chained), naming each action and spec.

    Warns:
        ActionReadWarning: once the env took the step: each action, its spec and how it was read.
    """
    try:
        outcome = step(*args)
    except Exception as err:
        raise ActionSpecError(" ".join(misfit.error(err) for misfit in misfits)) from err
    for misfit in misfits:  # Python's default filter shows a warning once per place in a process
        warnings.warn(misfit.warning(), ActionReadWarning, stacklevel=3)
    return outcome
