"""``service_backend(name)``: the backend ``Collector(...)`` picks when none is given, for a block of code.

TorchRL 0.14 has the same context manager (``torchrl.service_backend``); code written for it keeps
working after the switch to rlharvest, whichever of the two contexts it enters: rlharvest honours
TorchRL's context too when torchrl is already imported (rlharvest never imports it). Only
``Collector(...)`` itself reads the context, and only when its ``backend`` argument is None
(docs/torchrl-compatibility.md, "Service backends").
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from typing import Iterator

__all__ = ["service_backend", "current_service_backend", "SERVICE_BACKENDS"]

#: every name TorchRL 0.14's context accepts; Collector refuses those it cannot build ("thread", "monarch")
SERVICE_BACKENDS = ("direct", "thread", "process", "ray", "rpc", "submitit", "monarch", "distributed")
_ALIASES = {"threading": "thread", "multiprocessing": "process"}

# (pid, backend): a forked worker inherits the variable but must not build its collector with the parent's
# choice (a worker's Collector would itself start workers).
_CONTEXT: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar("rlharvest_service_backend",
                                                                                  default=None)


def _canonical(backend: str) -> str:
    name = _ALIASES.get(backend, backend) if isinstance(backend, str) else backend
    if name not in SERVICE_BACKENDS:
        raise ValueError(f"service backend must be one of {sorted(set(SERVICE_BACKENDS) | set(_ALIASES))}, "
                         f"got {backend!r}")
    return name


@contextlib.contextmanager
def service_backend(backend: str) -> Iterator[None]:
    """Make ``backend`` the default of ``Collector(..., backend=None)`` inside the ``with`` block.

    An explicit ``backend=`` argument wins. The context belongs to this thread (or task) and this
    process: worker processes forked inside it and new threads do not see it. It is restored on exit.

    Args:
        backend: one of ``"direct"``, ``"process"`` (or ``"multiprocessing"``), ``"distributed"``,
            ``"rpc"``, ``"submitit"``, ``"ray"``; ``"thread"`` (``"threading"``) and ``"monarch"`` are
            accepted here, as TorchRL does, and refused by ``Collector``.

    Raises:
        ValueError: for any other name.

    Example:
        >>> from rlharvest import service_backend
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> with service_backend("process"):
        ...     collector = Collector(CountingEnv, frames_per_batch=4, total_frames=8, num_collectors=2)
        >>> type(collector).__name__
        'MultiAsyncCollector'
        >>> collector.shutdown()
    """
    token = _CONTEXT.set((os.getpid(), _canonical(backend)))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_service_backend() -> tuple[str | None, str | None]:
    """The backend of the enclosing context and which context set it (``"rlharvest"`` or ``"torchrl"``).

    rlharvest's own context comes first. TorchRL's is read only if torchrl is already imported (by the
    user); a TorchRL that no longer has the private function simply has no context for rlharvest.
    """
    value = _CONTEXT.get()
    if value is not None and value[0] == os.getpid():
        return value[1], "rlharvest"
    backends = sys.modules.get("torchrl._comm.backends")
    getter = getattr(backends, "_get_service_backend", None)
    if getter is not None:
        try:
            backend = getter()
        except Exception:  # a changed private API must not break collectors
            backend = None
        if backend is not None:
            return _canonical(backend), "torchrl"
    return None, None
