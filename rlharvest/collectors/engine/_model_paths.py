"""Model ids that point into a TorchRL env's transforms, read the way TorchRL's collector reads them.

Given ``max_frames_per_traj``, TorchRL's collector wraps its env in ``TransformedEnv(env,
StepCounter(...))``; when the env is itself a ``TransformedEnv``, TorchRL unwraps it, so the collector's
``env.transform`` is a ``Compose`` of the env's own transforms (those of a ``Compose`` one by one)
followed by the ``StepCounter``. Weight-sync model ids are written against that env: TorchRL's example
``"env.transform[0].module"`` names the env's first transform. rlharvest counts steps in the rollout
and keeps the env as it was built, so it reads such an id through the same list
(docs/torchrl-compatibility.md, "Model ids"). The transforms a recurrent policy needs, which TorchRL
appends to the env's own list (``auto_register_policy_transforms=True``), rlharvest appends in a new
env around it: the list reads through that one too.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from ..._utils import resolve_attr_path
from ...envs.policy_transforms import appended_by_collector

__all__ = ["resolve_env_transform_path"]

_TRANSFORM_INDEX = re.compile(r"^env\.transform\[(-?\d+)\](.*)$")


def _torchrl_transforms(env: Any) -> list | None:
    """The env's transforms as TorchRL's collector lists them, or None when ``env`` is not exactly
    TorchRL's ``TransformedEnv`` (TorchRL unwraps no other type)."""
    envs = sys.modules.get("torchrl.envs")  # only a user who built a TorchRL env has imported it
    transformed, compose = getattr(envs, "TransformedEnv", None), getattr(envs, "Compose", None)
    if transformed is None or type(env) is not transformed:
        return None
    transform = env.transform
    own = list(transform) if type(transform) is compose else [transform]
    if appended_by_collector(env):  # the user's env, then what the policy needed
        return (_torchrl_transforms(env.base_env) or []) + own
    return own


def resolve_env_transform_path(env: Any, model_id: str, step_counter: bool = True) -> tuple[bool, Any]:
    """``(True, model)`` for an ``"env.transform[i]..."`` id read as TorchRL's collector reads it
    (``step_counter``: with ``max_frames_per_traj``, which appends one); ``(False, None)`` when the id
    is to be resolved against the env as built.

    Raises:
        ValueError: when the index names TorchRL's added ``StepCounter``, which rlharvest does not add.
        IndexError: for an index past it.
    """
    match = _TRANSFORM_INDEX.match(model_id)
    if match is None:
        return False, None
    transforms = _torchrl_transforms(env)
    if transforms is None:
        return False, None
    index, rest = int(match.group(1)), match.group(2)
    position = index + len(transforms) + step_counter if index < 0 else index
    if step_counter and position == len(transforms):
        raise ValueError(f"{model_id!r} names the StepCounter TorchRL's collector appends for max_frames_per_traj: "
                         "rlharvest counts steps in the rollout, without a transform, so it has no weights to sync.")
    model = transforms[position] if 0 <= position < len(transforms) else transforms[index]  # IndexError as a list's
    return True, resolve_attr_path(model, rest.lstrip(".")) if rest else model
