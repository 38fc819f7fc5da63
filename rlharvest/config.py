"""Collector arguments, parsed and validated once into a frozen dataclass.

The public constructors keep TorchRL's keyword arguments (their signatures list every one);
inside, everything reads a :class:`CollectorConfig`. Each argument is a field with its validation
and a rule saying how it reaches workers and nodes (:meth:`CollectorConfig.for_worker`), so adding a
TorchRL argument means adding a field here and the parameter to the public signatures: nothing
forwards arguments by hand. Each check raises one clear error naming the argument and the allowed
values. docs/collection.md describes what the arguments do.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, Callable, Mapping

import torch

from ._utils import CloudpickleWrapper, positive_int, positive_seconds, user_stacklevel
from .config_views import FrameBudget, FramesPerBatch, OutputRules
from .policies import ExplorationType

__all__ = ["CollectorConfig", "FrameBudget", "OutputRules", "check_restart_arguments", "parse_total_frames",
           "positive_seconds", "resolve_devices", "validate_exploration_type"]

_TRAJ_FORMAT_DEFAULT = (
    "trajs_per_batch is set but traj_format is not: batches are 'padded' (trajs_per_batch, max_len) with a "
    "('collector', 'mask') for now, but the default will change to 'cat' in torchrl v0.16, and rlharvest follows "
    "it. Pass traj_format='padded' to keep this layout, or traj_format='cat' for trajectories concatenated along "
    "time, without padding."
)


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


def _optional_count(name: str, value: Any) -> int:
    """None, 0 and negative values mean 'off' (0)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    return max(0, value)


def check_grace(preemption_grace: Any) -> float:
    """Validate ``preemption_grace`` (finite seconds >= 0).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    if isinstance(preemption_grace, bool) or not isinstance(preemption_grace, (int, float)):
        raise TypeError(f"preemption_grace must be a number of seconds >= 0, got {type(preemption_grace).__name__} "
                        f"{preemption_grace!r}")
    if not math.isfinite(preemption_grace) or preemption_grace < 0:
        raise ValueError(f"preemption_grace must be a finite number of seconds >= 0, got {preemption_grace!r}")
    return float(preemption_grace)


def check_restart_arguments(max_worker_restarts, restart_delay) -> tuple[int, float]:
    """Validate ``max_worker_restarts`` (an int >= 0) and ``restart_delay`` (finite seconds >= 0).

    Raises:
        TypeError: naming the argument, for a value of the wrong type.
        ValueError: naming the argument, for a negative (or infinite) value.
    """
    if isinstance(max_worker_restarts, bool) or not isinstance(max_worker_restarts, int):
        raise TypeError(f"max_worker_restarts must be an int >= 0 (0: a failed worker raises WorkerError), got "
                        f"{type(max_worker_restarts).__name__} {max_worker_restarts!r}")
    if max_worker_restarts < 0:
        raise ValueError(f"max_worker_restarts must be an int >= 0, got {max_worker_restarts!r}")
    if isinstance(restart_delay, bool) or not isinstance(restart_delay, (int, float)):
        raise TypeError(f"restart_delay must be a number of seconds >= 0, got {type(restart_delay).__name__} "
                        f"{restart_delay!r}")
    if not math.isfinite(restart_delay) or restart_delay < 0:
        raise ValueError(f"restart_delay must be a finite number of seconds >= 0, got {restart_delay!r}")
    return max_worker_restarts, float(restart_delay)


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
    """Fill devices left as None (docs/collection.md, "Devices"). Returns (storing, policy, env).

    The storing device comes from the arguments alone, as TorchRL decides it: ``storing_device``,
    else ``device``, else the env and policy device when both were given and agree; otherwise None
    (batches without a device, their leaves where they were produced). The env's own device fills
    ``env_device`` only afterwards, so it never decides where batches are stored.
    """
    device = _device(device)
    storing_device = _device(storing_device) or device
    policy_device = _device(policy_device) or device
    env_device = _device(env_device) or device
    if storing_device is None and env_device == policy_device:
        storing_device = env_device
    if env_device is None and env is not None:
        from .envs.adapters import env_attr

        env_device = _device(env_attr(env, "device"))
    return storing_device, policy_device, env_device


# ---------------------------------------------------------------------------------- how fields reach workers
_OMIT = object()


def _same(value: Any, index: int) -> Any:
    """Every worker's collector gets the value."""
    return value


def _each(value: Any, index: int) -> Any:
    """One value for every worker, or a sequence with one entry per worker."""
    return value[index] if isinstance(value, (list, tuple)) else value


def _parent(value: Any, index: int) -> Any:
    """Used by the collector that owns the workers only (workers get an override, or nothing)."""
    return _OMIT


def _flag(value: Any, index: int) -> Any:
    """Workers get the truth value (a version tracker object stays in the parent)."""
    return bool(value)


def _pickled(value: Any, index: int) -> Any:
    """A user callable workers get through cloudpickle (lambdas and local functions survive spawn)."""
    return CloudpickleWrapper(value) if value is not None else None


def _arg(default: Any = None, *, worker: Callable[[Any, int], Any] = _same, factory: Callable | None = None):
    metadata = {"worker": worker}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


_DEVICE_FIELDS = ("device", "storing_device", "policy_device", "env_device")


@dataclass(frozen=True)
class CollectorConfig:
    """The TorchRL arguments every collector shares, validated (docs/collection.md)."""

    frames_per_batch: int | tuple[int, ...] | None = _arg(worker=_parent)
    """Frames per yielded batch of a ``Collector`` (checked by ``FramesPerBatch``); None in the options of
    a collector with workers, which hold it apart (``with_frames`` shows it)."""
    total_frames: int = _arg(-1, worker=_parent)
    """Stop after this many frames; -1 = endless (workers always are)."""
    total_frames_given: Any = _arg(None, worker=_parent)
    """``total_frames`` as the user gave it (``-5``, ``None``...), for messages; set from it."""
    device: Any = _arg(worker=_each)
    storing_device: Any = _arg(worker=_each)
    policy_device: Any = _arg(worker=_each)
    env_device: Any = _arg(worker=_each)
    create_env_kwargs: Any = _arg(worker=_each, factory=dict)
    """Keyword arguments of the env constructor (a dict, or one dict per worker)."""
    max_frames_per_traj: int = _arg(0)
    """Truncate trajectories after this many steps; 0 = off."""
    init_random_frames: int = _arg(0, worker=_parent)
    """Random actions until this many frames were collected; 0 = off (the parent decides)."""
    reset_at_each_iter: bool = _arg(False)
    postproc: Callable | None = _arg(worker=_parent)
    split_trajs: bool = _arg(False, worker=_parent)
    exploration_type: Any = _arg(ExplorationType.RANDOM)
    return_same_td: bool = _arg(False, worker=_parent)
    interruptor: Any = _arg(worker=_parent)
    set_truncated: bool = _arg(False)
    use_buffers: bool | None = _arg()
    replay_buffer: Any = _arg(worker=_parent)
    extend_buffer: bool = _arg(True, worker=_parent)
    trust_policy: bool | None = _arg()
    compile_policy: Any = _arg()
    cudagraph_policy: Any = _arg()
    no_cuda_sync: bool = _arg(False)
    track_policy_version: Any = _arg(False, worker=_flag)
    worker_idx: int | None = _arg(worker=_parent)
    pre_collect_hook: Callable[[], None] | None = _arg(worker=_pickled)
    """Called with no argument before each batch is collected (in the process that collects it)."""
    post_collect_hook: Callable | None = _arg(worker=_pickled)
    """Called with each collected batch (in the process that collects it)."""
    track_traj_ids: bool = _arg(True)
    """Keep ``("collector", "traj_ids")`` in batches (False: no id bookkeeping at all)."""
    compact_obs: bool = _arg(False)
    """Drop the observations from ``("next", ...)``: they are the next step's root entries."""
    trajs_per_batch: int | None = _arg(worker=_parent)
    """Yield batches of exactly this many complete trajectories (None: fixed frame batches); with a
    replay buffer, write complete trajectories only. ``frames_per_batch`` is then the polling size and
    ``split_trajs`` has no effect (docs/trajectories.md)."""
    trajs_per_write: int | None = _arg(worker=_parent)
    """With a replay buffer and ``trajs_per_batch``: complete trajectories per ``extend`` call (None: all
    that are ready)."""
    replay_write_mode: str | None = _arg(worker=_parent)
    """What goes to the replay buffer: ``"rollout"`` (whole batches), ``"trajectory"`` (complete
    trajectories), None: as ``trajs_per_batch`` says (docs/trajectories.md)."""
    traj_format: str | None = _arg(worker=_parent)
    """``"padded"`` ``(trajs, max_len)`` with a mask, or ``"cat"`` (concatenated along time); None means
    ``"padded"`` (with a ``FutureWarning`` when batches are yielded)."""
    auto_register_policy_transforms: bool | None = _arg()
    """The transforms a TorchRL recurrent policy needs (``InitTracker``, its primers), where the env is
    built: True steps a new env around the given one with them appended, None warns when some are
    missing, False says nothing (docs/torchrl-compatibility.md, "TorchRL's next release")."""
    max_worker_restarts: int = _arg(0, worker=_parent)
    """Failed workers the collector replaces over its life before it raises (0: the first failure
    raises ``WorkerError``, as without restarts). docs/restarts.md."""
    restart_delay: float = _arg(0.0, worker=_parent)
    """Seconds to wait before a failed worker's replacement starts."""
    preemption_grace: float = _arg(5.0, worker=_parent)
    """Seconds a worker that receives SIGTERM has to finish its rollout before it hands it back and
    leaves (a preemption is a leave, not a failure). docs/elastic.md."""

    @classmethod
    def from_kwargs(cls, owner: str, **kwargs) -> CollectorConfig:
        """Build from a collector's keyword arguments; unknown ones raise ``TypeError`` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise TypeError(f"{owner} got unexpected keyword argument(s) {unknown}.")
        return cls(**kwargs)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> CollectorConfig:
        """Build from a constructor's arguments (``dict(locals())``): the fields found there are taken,
        everything else (the env, the policy, the collector's own arguments) is left to the caller."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.frames_per_batch is not None:  # None: a collector with workers holds it apart (FramesPerBatch)
            set_(self, "frames_per_batch", FramesPerBatch.parse(self.frames_per_batch).value)
        if self.total_frames_given is None:
            set_(self, "total_frames_given", self.total_frames)
        set_(self, "total_frames", parse_total_frames(self.total_frames))
        for name in _DEVICE_FIELDS:
            value = getattr(self, name)
            set_(self, name, [_device(v) for v in value] if isinstance(value, (list, tuple)) else _device(value))
        env_kwargs = self.create_env_kwargs
        set_(self, "create_env_kwargs", [dict(k or {}) for k in env_kwargs] if isinstance(env_kwargs, (list, tuple))
             else dict(env_kwargs or {}))
        set_(self, "max_frames_per_traj", _optional_count("max_frames_per_traj", self.max_frames_per_traj))
        set_(self, "init_random_frames", _optional_count("init_random_frames", self.init_random_frames))
        set_(self, "split_trajs", bool(self.split_trajs))
        set_(self, "exploration_type", validate_exploration_type(self.exploration_type))
        for name in ("pre_collect_hook", "post_collect_hook"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}")
        if self.auto_register_policy_transforms not in (None, True, False):
            raise ValueError(f"auto_register_policy_transforms must be True, False or None, got "
                             f"{self.auto_register_policy_transforms!r}.")
        restarts, delay = check_restart_arguments(self.max_worker_restarts, self.restart_delay)
        set_(self, "max_worker_restarts", restarts)
        set_(self, "restart_delay", delay)
        set_(self, "preemption_grace", check_grace(self.preemption_grace))
        self._check_trajectory_options()
        self._check_buffer_options()

    def _check_trajectory_options(self) -> None:
        set_ = object.__setattr__
        if self.trajs_per_batch is not None:
            set_(self, "trajs_per_batch", positive_int("trajs_per_batch", self.trajs_per_batch))
            if not self.track_traj_ids:
                raise ValueError("trajs_per_batch needs track_traj_ids=True: trajectories are cut along their "
                                 "('collector', 'traj_ids').")
        self._check_replay_write_mode()
        if self.trajs_per_write is not None:
            if self.replay_buffer is None or not self.assembles_trajectories:
                raise ValueError(f"trajs_per_write={self.trajs_per_write!r} needs a replay_buffer written with "
                                 "complete trajectories (trajs_per_batch, or replay_write_mode='trajectory').")
            set_(self, "trajs_per_write", positive_int("trajs_per_write", self.trajs_per_write))
        if self.traj_format is None:
            if self.trajs_per_batch is not None and self.replay_buffer is None:
                warnings.warn(_TRAJ_FORMAT_DEFAULT, FutureWarning, stacklevel=user_stacklevel())
            set_(self, "traj_format", "padded")
        elif self.traj_format not in ("padded", "cat"):
            raise ValueError(f"traj_format must be 'padded' or 'cat', got {self.traj_format!r}")
        elif self.traj_format != "padded" and self.trajs_per_batch is None:
            raise ValueError(f"traj_format={self.traj_format!r} needs trajs_per_batch: only batches of complete "
                             "trajectories have a layout to choose.")

    def _check_replay_write_mode(self) -> None:
        """Raises: ValueError for another mode, one without a replay buffer or beside ``trajs_per_batch``."""
        mode = self.replay_write_mode
        if mode not in (None, "rollout", "trajectory"):
            raise ValueError(f"replay_write_mode must be 'rollout', 'trajectory' or None, got {mode!r}.")
        if mode is not None and self.replay_buffer is None:
            raise ValueError(f"replay_write_mode={mode!r} needs a replay_buffer.")
        if mode is not None and self.trajs_per_batch is not None:
            raise ValueError(f"replay_write_mode={mode!r} with trajs_per_batch={self.trajs_per_batch}: "
                             "trajs_per_batch already writes complete trajectories; give one of them.")

    @property
    def assembles_trajectories(self) -> bool:
        """Whether complete trajectories are assembled (``trajs_per_batch``, ``replay_write_mode="trajectory"``)."""
        return self.output_rules.assembles_trajectories

    @property
    def output_rules(self) -> OutputRules:
        """What the part that post-processes and writes batches reads (no batch size)."""
        return OutputRules(self.split_trajs, self.postproc, self.trajs_per_batch, self.trajs_per_write,
                           self.traj_format, self.replay_write_mode, self.reset_at_each_iter)

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

    # ------------------------------------------------------------------ frames
    @property
    def budget(self) -> FrameBudget:
        """What the collector's counters read (no batch size)."""
        return FrameBudget(self.total_frames, self.total_frames_given, self.init_random_frames, self.replay_buffer)

    @property
    def endless(self) -> bool:
        return self.total_frames < 0

    def num_batches(self, frames_per_batch: int) -> int:
        """``len(collector)`` (:meth:`FrameBudget.num_batches`)."""
        return self.budget.num_batches(frames_per_batch)

    def with_frames(self, frames: FramesPerBatch) -> CollectorConfig:
        """This config with ``frames``, checked already, as its ``frames_per_batch`` (a collector with
        workers holds its batch size apart from its options: ``collector.config`` shows what was given,
        and each worker's config its share)."""
        shown = copy.copy(self)
        object.__setattr__(shown, "frames_per_batch", frames.value)
        return shown

    # ------------------------------------------------------------------ workers
    def check_workers(self, num_workers: int) -> None:
        """Check that every per-worker sequence has one entry per worker.

        Raises:
            RuntimeError: for a device sequence of the wrong length.
            ValueError: for another per-worker sequence of the wrong length.
        """
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.metadata["worker"] is not _each or not isinstance(value, (list, tuple)) or len(value) == num_workers:
                continue
            if spec.name in _DEVICE_FIELDS:
                raise RuntimeError(f"{spec.name} must be a single device or a sequence of {num_workers} devices "
                                   f"(one per worker), got {len(value)}.")
            raise ValueError(f"{spec.name} must have exactly one value per worker ({num_workers}), got {len(value)}.")

    def grown(self, count: int) -> CollectorConfig:
        """This config with ``count`` more workers: a per-worker sequence whose entries are all equal
        (``AsyncCollector``'s one-entry ``create_env_kwargs``) gets that entry for each new worker; one
        with different entries is left as it is, for :meth:`check_workers` to refuse."""
        changes = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.metadata["worker"] is _each and isinstance(value, (list, tuple)) and value \
                    and all(entry == value[0] for entry in value):
                changes[spec.name] = type(value)([*value] + [value[0]] * count)
        return replace(self, **changes) if changes else self

    def worker_config(self, index: int, **overrides: Any) -> CollectorConfig:
        """The config of worker ``index``'s collector, typed (docs/architecture.md): every field as the
        field's rule gives it to workers (this worker's entry of a per-worker sequence, a flag, a
        pickled hook), the fields only this collector uses back at their defaults, then ``overrides``."""
        changes: dict[str, Any] = {}
        for spec in fields(self):
            value = spec.metadata["worker"](getattr(self, spec.name), index)
            if value is _OMIT:
                value = spec.default_factory() if callable(spec.default_factory) else spec.default
            changes[spec.name] = value
        changes.update(overrides)
        return replace(self, **changes)

    def for_worker(self, index: int, **overrides: Any) -> dict[str, Any]:
        """The keyword arguments of worker ``index``'s collector when it is a class of the user's own
        (ours are given :meth:`worker_config`, typed).

        Every field workers take (with this worker's entry of a per-worker sequence), then
        ``overrides``. Values equal to a field's default are left out: the worker's collector
        class (a node may run any) then need not take arguments the user never set.
        """
        kwargs = {}
        for spec in fields(self):
            value = spec.metadata["worker"](getattr(self, spec.name), index)
            if value is not _OMIT and not _is_default(spec, value):
                kwargs[spec.name] = value
        kwargs.update(overrides)
        return kwargs

    def policy_device_of(self, index: int) -> torch.device:
        """The device worker ``index`` runs its policy on (weights are staged there)."""
        return _each(self.policy_device, index) or _each(self.device, index) or torch.device("cpu")


def _is_default(spec: Field, value: Any) -> bool:
    default = spec.default_factory() if callable(spec.default_factory) else spec.default
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # values whose == is not a truth value (tensors): never equal to a default
        return False
