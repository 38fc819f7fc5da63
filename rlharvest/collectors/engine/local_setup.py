"""How a ``LocalEngine`` is set up from its options: checks of the env against the arguments, a compiled
policy (docs/collection.md). The rollout's settings, the frames of a batch among them, are
``RolloutSettings.of`` (``rollout.py``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..._utils import as_tuple_key, user_stacklevel
from ...config import CollectorConfig
from ...envs.adapters import env_attr
from ...envs.factory import env_keys
from ...rollout import Rollout

__all__ = ["check_env_options", "compile_policy"]


def check_env_options(config: CollectorConfig, env: Any) -> None:
    """Raises: ValueError or RuntimeError for options the env cannot honour (``max_frames_per_traj`` with a
    step counter of its own, ``set_truncated`` without a truncated key)."""
    if config.max_frames_per_traj and ("step_count",) in env_keys(env):
        raise ValueError("max_frames_per_traj is set but the env already has a 'step_count' entry (a step "
                         "counter); remove one of them.")
    done_keys = [as_tuple_key(k)[-1] for k in env_attr(env, "done_keys", [])]
    if config.set_truncated and "truncated" not in done_keys and not config.max_frames_per_traj:
        raise RuntimeError("set_truncated=True requires the env to have a 'truncated' done key (or "
                           "max_frames_per_traj).")


def compile_policy(config: CollectorConfig, rollout: Rollout) -> None:
    """``compile_policy``: ``torch.compile`` the policy's stages (``cudagraph_policy`` warns without CUDA)."""
    options = config.compile_policy
    if options:
        kwargs = options if isinstance(options, dict) else {}
        step = rollout.policy_step
        if hasattr(step, "stages"):
            step.stages = [(torch.compile(m, **kwargs), i, o) for m, i, o in step.stages]
        elif hasattr(step, "policy"):
            step.policy = torch.compile(step.policy, **kwargs)
    if config.cudagraph_policy and not torch.cuda.is_available():
        warnings.warn("cudagraph_policy needs CUDA; it is ignored on this machine.", stacklevel=user_stacklevel())
