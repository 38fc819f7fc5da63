"""Collector arguments, parsed and validated once into frozen dataclasses.

The public constructors keep TorchRL's keyword arguments; inside, everything reads a config object.
Each check raises one clear error that names the argument and the allowed values.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from .policies import ExplorationType

__all__ = ["CollectorConfig", "parse_total_frames", "positive_seconds", "resolve_devices", "validate_exploration_type"]

_TRAJ_FORMAT_DEFAULT = (
    "trajs_per_batch is set but traj_format is not: batches are 'padded' (trajs_per_batch, max_len) with a "
    "('collector', 'mask') for now, but the default will change to 'cat' in torchrl v0.16, and rlharvest follows "
    "it. Pass traj_format='padded' to keep this layout, or traj_format='cat' for trajectories concatenated along "
    "time, without padding."
)


def _stacklevel_outside_package() -> int:
    """The ``stacklevel`` of the first caller outside rlharvest (as seen from the function calling this)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "rlharvest":
        frame, level = frame.f_back, level + 1
    return level


def parse_total_frames(total_frames: Any) -> int:
    """``None`` or any negative value means endless (-1)."""
    if total_frames is None:
        return -1
    if isinstance(total_frames, float):
        if total_frames == float("inf"):
            return -1
        total_frames = int(total_frames)
    if not isinstance(total_frames, int):
        raise TypeError(f"total_frames must be an int (-1 for endless), got {type(total_frames).__name__}")
    return -1 if total_frames < 0 else total_frames


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def positive_seconds(name: str, value: Any) -> float:
    """A timeout argument: a positive, finite number of seconds (every wait must end).

    Raises:
        TypeError: naming ``name`` for a non-number.
        ValueError: naming ``name`` for zero, negative, infinite or NaN values.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def _optional_count(name: str, value: Any) -> int:
    """None, 0 and negative values mean 'off' (0)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    return max(0, value)


def validate_exploration_type(value: Any):
    if value is None:
        return ExplorationType.RANDOM
    allowed = (ExplorationType.RANDOM, ExplorationType.DETERMINISTIC, ExplorationType.MODE, ExplorationType.MEAN)
    for member in allowed:
        if value == member or (isinstance(value, str) and value.lower() in (member.value, member.name.lower())):
            return member
    names = ", ".join(f"ExplorationType.{v.name}" for v in allowed)
    raise ValueError(f"exploration_type must be one of {names}, got {value!r}")


def _device(value: Any) -> torch.device | None:
    return torch.device(value) if value is not None else None


def resolve_devices(device, storing_device, policy_device, env_device, env=None):
    """Fill devices left as None (SPEC §2.7). Returns (storing, policy, env)."""
    device = _device(device)
    storing_device = _device(storing_device) or device
    policy_device = _device(policy_device) or device
    env_device = _device(env_device) or device
    if env_device is None and env is not None:
        from .envs.adapters import env_attr

        env_device = _device(env_attr(env, "device"))
    if storing_device is None and env_device is not None and env_device == policy_device:
        storing_device = env_device
    if storing_device is None and env_device is not None and policy_device is None:
        storing_device = env_device
    return storing_device, policy_device, env_device


@dataclass(frozen=True)
class CollectorConfig:
    """The arguments every collector shares (SPEC §2), validated."""

    frames_per_batch: int
    """Frames per yielded batch (rounded up to a multiple of the env batch size by Collector)."""
    total_frames: int = -1
    """Stop after this many frames; -1 = endless."""
    device: torch.device | None = None
    storing_device: torch.device | None = None
    policy_device: torch.device | None = None
    env_device: torch.device | None = None
    create_env_kwargs: dict = field(default_factory=dict)
    max_frames_per_traj: int = 0
    """Truncate trajectories after this many steps; 0 = off."""
    init_random_frames: int = 0
    """Random actions until this many frames were collected; 0 = off."""
    reset_at_each_iter: bool = False
    postproc: Callable | None = None
    split_trajs: bool = False
    exploration_type: Any = ExplorationType.RANDOM
    return_same_td: bool = False
    interruptor: Any = None
    set_truncated: bool = False
    use_buffers: bool | None = None
    replay_buffer: Any = None
    extend_buffer: bool = True
    trust_policy: bool | None = None
    compile_policy: Any = None
    cudagraph_policy: Any = None
    no_cuda_sync: bool = False
    track_policy_version: Any = False
    worker_idx: int | None = None
    pre_collect_hook: Callable[[], None] | None = None
    """Called with no argument before each batch is collected (in the process that collects it)."""
    post_collect_hook: Callable | None = None
    """Called with each collected batch (in the process that collects it)."""
    track_traj_ids: bool = True
    """Keep ``("collector", "traj_ids")`` in batches (False: no id bookkeeping at all)."""
    compact_obs: bool = False
    """Drop the observations from ``("next", ...)``: they are the next step's root entries."""
    trajs_per_batch: int | None = None
    """Yield batches of exactly this many complete trajectories (None: fixed frame batches); with a
    replay buffer, write complete trajectories only. ``frames_per_batch`` is then the polling size and
    ``split_trajs`` has no effect (docs/trajectories.md)."""
    trajs_per_write: int | None = None
    """With a replay buffer and ``trajs_per_batch``: complete trajectories per ``extend`` call (None: all
    that are ready)."""
    traj_format: str | None = None
    """``"padded"`` ``(trajs, max_len)`` with a mask, or ``"cat"`` (concatenated along time); None means
    ``"padded"`` (with a ``FutureWarning`` when batches are yielded)."""
    auto_register_policy_transforms: bool | None = None
    """TorchRL-module specific (recurrent-state primers): only None/False are supported."""

    @classmethod
    def from_kwargs(cls, owner: str, **kwargs) -> CollectorConfig:
        """Build from a collector's keyword arguments; unknown ones raise ``TypeError`` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise TypeError(f"{owner} got unexpected keyword argument(s) {unknown}.")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.frames_per_batch is None:
            raise TypeError("frames_per_batch is required.")
        if not isinstance(self.frames_per_batch, (list, tuple)):
            if isinstance(self.frames_per_batch, bool) or not isinstance(self.frames_per_batch, int):
                raise TypeError(f"frames_per_batch must be a positive int, got {type(self.frames_per_batch).__name__} "
                                f"{self.frames_per_batch!r}")
            set_(self, "frames_per_batch", _positive_int("frames_per_batch", self.frames_per_batch))
        set_(self, "total_frames", parse_total_frames(self.total_frames))
        for name in ("device", "storing_device", "policy_device", "env_device"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                set_(self, name, _device(value))
        set_(self, "create_env_kwargs", dict(self.create_env_kwargs or {}))
        set_(self, "max_frames_per_traj", _optional_count("max_frames_per_traj", self.max_frames_per_traj))
        set_(self, "init_random_frames", _optional_count("init_random_frames", self.init_random_frames))
        set_(self, "split_trajs", bool(self.split_trajs))
        set_(self, "exploration_type", validate_exploration_type(self.exploration_type))
        for name in ("pre_collect_hook", "post_collect_hook"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}")
        if self.auto_register_policy_transforms:
            raise ValueError(
                "auto_register_policy_transforms=True is not supported: rlharvest does not edit your env. Add the "
                "transforms the policy needs (e.g. TorchRL's TensorDictPrimer / InitTracker for recurrent modules) "
                "to the env yourself, and pass None or False."
            )
        self._check_trajectory_options()
        self._check_buffer_options()

    def _check_trajectory_options(self) -> None:
        set_ = object.__setattr__
        if self.trajs_per_batch is not None:
            set_(self, "trajs_per_batch", _positive_int("trajs_per_batch", self.trajs_per_batch))
            if not self.track_traj_ids:
                raise ValueError("trajs_per_batch needs track_traj_ids=True: trajectories are cut along their "
                                 "('collector', 'traj_ids').")
        if self.trajs_per_write is not None:
            if self.trajs_per_batch is None or self.replay_buffer is None:
                raise ValueError("trajs_per_write needs trajs_per_batch and a replay_buffer.")
            set_(self, "trajs_per_write", _positive_int("trajs_per_write", self.trajs_per_write))
        if self.traj_format is None:
            if self.trajs_per_batch is not None and self.replay_buffer is None:
                warnings.warn(_TRAJ_FORMAT_DEFAULT, FutureWarning, stacklevel=_stacklevel_outside_package())
            set_(self, "traj_format", "padded")
        elif self.traj_format not in ("padded", "cat"):
            raise ValueError(f"traj_format must be 'padded' or 'cat', got {self.traj_format!r}")
        elif self.traj_format != "padded" and self.trajs_per_batch is None:
            raise ValueError(f"traj_format={self.traj_format!r} needs trajs_per_batch: only batches of complete "
                             "trajectories have a layout to choose.")

    def _check_buffer_options(self) -> None:
        if self.replay_buffer is None:
            return
        if not hasattr(self.replay_buffer, "extend"):
            raise TypeError(f"replay_buffer must have an extend() method, got {type(self.replay_buffer).__name__}")
        if self.use_buffers:
            raise TypeError("use_buffers=True cannot be used with a replay_buffer (the buffer is the storage).")
        if not self.extend_buffer:
            warnings.warn("extend_buffer=False is deprecated: batches are written step by step.", DeprecationWarning)
            if self.postproc is not None or self.split_trajs:
                raise TypeError("postproc and split_trajs require extend_buffer=True when a replay_buffer is used.")

    @property
    def endless(self) -> bool:
        return self.total_frames < 0

    def num_batches(self, frames_per_batch: int) -> int:
        """``len(collector)``."""
        if self.endless:
            raise RuntimeError("Non-terminating collectors (total_frames=-1) have no length.")
        return math.ceil(self.total_frames / frames_per_batch)
