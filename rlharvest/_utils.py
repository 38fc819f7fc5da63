"""Small helpers shared across layers: nested keys, attribute paths, pickling wrappers, warnings, argument
checks."""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
import re
import warnings
from typing import Any

import cloudpickle
import torch
from tensordict.utils import NestedKey, unravel_key

__all__ = [
    "TRAJ_IDS",
    "MASK",
    "NestedKey",
    "unravel_key",
    "as_tuple_key",
    "is_private_key",
    "resolve_attr_path",
    "import_object",
    "CloudpickleWrapper",
    "deprecated_alias",
    "cpu_count",
    "positive_int",
    "positive_seconds",
]


#: the batch entry holding each step's trajectory id (-1: a step that was not collected)
TRAJ_IDS = ("collector", "traj_ids")
#: the batch entry marking the valid steps of padded trajectories
MASK = ("collector", "mask")


def as_tuple_key(key: NestedKey) -> tuple[str, ...]:
    """``"a"`` -> ``("a",)``; ``("a", ("b",))`` -> ``("a", "b")``."""
    key = unravel_key(key)
    return (key,) if isinstance(key, str) else tuple(key)


@functools.lru_cache(maxsize=4096)
def is_private_key(key: NestedKey) -> bool:
    """True when any part of the key starts with ``_`` (such keys never leave a collector). Cached: every
    batch asks it of each of its keys, which are the same from batch to batch."""
    return any(part.startswith("_") for part in as_tuple_key(key))


_SEGMENT = re.compile(r"^([^\[\]]*)((?:\[[^\]]*\])*)$")
_SUBSCRIPT = re.compile(r"\[([^\]]*)\]")


def _parse_subscript(raw: str) -> int | str:
    raw = raw.strip()
    try:
        return int(raw)
    except ValueError:
        pass
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return raw


def resolve_attr_path(root: Any, path: str) -> Any:
    """Resolve ``"a.b['key'][0].c"`` on ``root``.

    Grammar: dot-separated segments; each segment is an attribute name optionally followed by
    subscripts ``[...]``; an int subscript indexes by int, otherwise quotes are stripped and it
    indexes by string. A segment may be subscripts only. Keys cannot contain ``]``.

    Raises:
        AttributeError: naming the missing segment.
        KeyError, IndexError: from the indexed container.
        ValueError: on a malformed path.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"attr_path must be a non-empty string, got {path!r}")
    obj = root
    for segment in path.split("."):
        match = _SEGMENT.match(segment)
        if match is None:
            raise ValueError(f"Malformed segment {segment!r} in attribute path {path!r}")
        name, subscripts = match.groups()
        if name:
            if not hasattr(obj, name):
                raise AttributeError(
                    f"{type(obj).__name__!s} object has no attribute {name!r} "
                    f"(segment {segment!r} of {path!r})"
                )
            obj = getattr(obj, name)
        elif not subscripts:
            raise ValueError(f"Empty segment in attribute path {path!r}")
        for raw in _SUBSCRIPT.findall(subscripts):
            obj = obj[_parse_subscript(raw)]
    return obj


def import_object(path: str) -> Any:
    """The object named by ``"package.module:name"``, looked up when called: the module is imported on
    first use, and an attribute replaced since (``mock.patch``, a user's substitute) is the one returned.
    """
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class CloudpickleWrapper:
    """Pickles its payload with cloudpickle, so lambdas and local functions cross process boundaries.

    Calling the wrapper calls the payload.
    """

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def __getstate__(self) -> bytes:
        return cloudpickle.dumps(self.payload)

    def __setstate__(self, state: bytes) -> None:
        self.payload = cloudpickle.loads(state)

    def __call__(self, *args, **kwargs):
        return self.payload(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CloudpickleWrapper({self.payload!r})"


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller of this function point at the first
    frame outside rlharvest: the user's line, however deep inside the package the warning is raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "rlharvest":
        frame, level = frame.f_back, level + 1
    return level


def wrap_callable(value: Any) -> Any:
    """Cloudpickle user callables so lambdas survive the spawn/forkserver start methods."""
    if value is None or isinstance(value, CloudpickleWrapper):
        return value
    return CloudpickleWrapper(value)


def unwrap(obj: Any) -> Any:
    """The payload of a CloudpickleWrapper, or the object itself."""
    return obj.payload if isinstance(obj, CloudpickleWrapper) else obj


def deprecated_alias(new_cls: type, old_name: str) -> type:
    """A subclass named ``old_name`` that warns on instantiation.

    ``isinstance`` works both ways: an old-name instance is a new-class instance by inheritance, and
    the metaclass makes any new-class instance pass ``isinstance(x, OldName)``.
    """

    class _AliasMeta(type(new_cls)):
        def __instancecheck__(cls, instance):
            return isinstance(instance, new_cls)

        def __subclasscheck__(cls, subclass):
            # by the MRO: asking new_cls's metaclass (an ABCMeta) would ask its subclasses, this one included
            return new_cls in getattr(subclass, "__mro__", ())

    def __init__(self, *args, **kwargs):
        warnings.warn(
            f"{old_name} is deprecated, use {new_cls.__name__} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        new_cls.__init__(self, *args, **kwargs)

    alias = _AliasMeta(old_name, (new_cls,), {"__init__": __init__, "__doc__": f"Deprecated name of {new_cls.__name__}."})
    alias.__module__ = new_cls.__module__
    return alias


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


#: environment variable choosing the CPU scheduling policy of worker processes and nodes
WORKER_SCHED_ENV = "RLHARVEST_WORKER_SCHED"
_WORKER_SCHED_CHOICES = ("batch", "normal")


def worker_scheduling() -> str:
    """The worker scheduling policy ``$RLHARVEST_WORKER_SCHED`` asks for (``"batch"`` by default).

    Collectors call it before starting workers, so a bad value fails in the main process.

    Raises:
        ValueError: for a value other than ``"batch"`` or ``"normal"``.
    """
    choice = os.environ.get(WORKER_SCHED_ENV, "").strip().lower() or "batch"
    if choice not in _WORKER_SCHED_CHOICES:
        raise ValueError(f"{WORKER_SCHED_ENV} must be one of {_WORKER_SCHED_CHOICES}, got {choice!r}")
    return choice


def use_worker_scheduling() -> str:
    """Put this worker process (or node) under the policy :func:`worker_scheduling` names.

    Called first thing in a worker process, so that every thread it starts inherits the policy.
    ``"batch"`` (Linux): ``SCHED_BATCH``, the kernel's policy for throughput processes. Same CPU share,
    but a worker that wakes up no longer preempts the running learner: with as many busy processes
    as cores, waking two workers for a weight update otherwise stalls the learner each time
    (measured on 2 cores: 1M-parameter updates ~20% faster, MultiAsync ~20% more frames/s).
    ``"normal"`` keeps the inherited policy. Returns the policy in effect; a node whose environment
    holds a bad value (the main process checked its own) warns and keeps the inherited policy.
    """
    try:
        choice = worker_scheduling()
    except ValueError as err:
        warnings.warn(f"{err}; keeping the inherited scheduling policy.", RuntimeWarning)
        return "normal"
    if choice == "batch" and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:  # pragma: no cover - a sandbox may forbid it; the default policy still works
            return "normal"
        return "batch"
    return "normal"


def to_device_list(value: Any, num_workers: int, name: str) -> list[torch.device | None]:
    """Normalise a device argument that may be one device or one per worker."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_workers:
            raise RuntimeError(
                f"{name} must be a single device or a sequence of {num_workers} devices "
                f"(one per worker), got {len(value)}."
            )
        return [torch.device(v) if v is not None else None for v in value]
    device = torch.device(value) if value is not None else None
    return [device] * num_workers


def positive_int(name: str, value: Any, *, allow_none: bool = False, owner: str | None = None) -> Any:
    """``value`` if it is a positive int (a bool is not), or None when ``allow_none``: the one check of
    a count argument, at every layer.

    Args:
        name: the argument, as the error names it.
        value: what was given.
        allow_none: None is allowed too (and returned).
        owner: who takes the argument, put before the message (``"AsyncBatchedCollector"``), or None.

    Raises:
        ValueError: naming ``name``, the value given and what is allowed.

    Example:
        >>> positive_int("num_workers", 2)
        2
        >>> positive_int("max_steps", 0, allow_none=True)
        Traceback (most recent call last):
        ...
        ValueError: max_steps must be a positive int or None, got 0
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{owner + ': ' if owner else ''}{name} must be {allowed}, got {value!r}")
    return value


def positive_seconds(name: str, value: Any) -> float:
    """A timeout argument: a positive, finite number of seconds (every wait must end).

    Raises:
        TypeError: naming ``name`` for a non-number.
        ValueError: naming ``name`` for zero, negative, infinite or NaN values.

    Example:
        >>> positive_seconds("worker_timeout", 5)
        5.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)
