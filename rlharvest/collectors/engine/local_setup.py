"""How a ``LocalEngine`` is set up from its options: checks of the env against the arguments, the frames
of a batch, the rollout's settings, a compiled policy (docs/collection.md)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..._utils import as_tuple_key, user_stacklevel
from ...config import CollectorConfig
from ...envs.adapters import env_attr
from ...envs.factory import env_keys
from ...rollout import Rollout, RolloutSettings

__all__ = ["check_env_options", "round_frames_per_batch", "rollout_settings", "compile_policy"]


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


def round_frames_per_batch(config: CollectorConfig, n_env: int) -> int:
    """``frames_per_batch`` rounded up to a multiple of the env batch size; warnings (at the user's line)
    when it was not one, or when ``total_frames`` or ``init_random_frames`` are not multiples of it."""
    frames_per_batch = config.frames_per_batch
    rounded = -(-frames_per_batch // n_env) * n_env
    if rounded != frames_per_batch:
        warnings.warn(f"frames_per_batch={frames_per_batch} is not a multiple of the env batch size ({n_env}); "
                      f"collecting {rounded} frames per batch.", stacklevel=user_stacklevel())
    total, random_frames = config.total_frames, config.init_random_frames
    if total > 0 and total % rounded:
        warnings.warn(f"total_frames={total} is not a multiple of frames_per_batch={rounded}: the last batch "
                      "will overshoot.", stacklevel=user_stacklevel())
    if random_frames and random_frames % rounded:
        warnings.warn(f"init_random_frames={random_frames} is not a multiple of frames_per_batch={rounded}: "
                      "random actions continue to the end of the batch that reaches it.",
                      stacklevel=user_stacklevel())
    return rounded


def rollout_settings(config: CollectorConfig, env: Any, frames_per_batch: int, devices: tuple) -> RolloutSettings:
    """The rollout loop's settings: time steps per batch, devices, buffers (preallocated unless a replay
    buffer is the storage or the env's specs are dynamic)."""
    storing, policy_device, env_device = devices
    n_env = int(env.batch_size.numel()) if len(env.batch_size) else 1
    dynamic = bool(env_attr(env, "_has_dynamic_specs", False))
    use_buffers = config.use_buffers
    if use_buffers is None:
        use_buffers = config.replay_buffer is None and not dynamic
    return RolloutSettings(
        time_steps=frames_per_batch // n_env, max_frames_per_traj=config.max_frames_per_traj,
        set_truncated=config.set_truncated, track_policy_version=bool(config.track_policy_version),
        exploration_type=config.exploration_type, storing_device=storing, policy_device=policy_device,
        env_device=env_device, use_buffers=use_buffers, track_traj_ids=config.track_traj_ids,
        compact_obs=config.compact_obs, lazy_stack=dynamic)


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
