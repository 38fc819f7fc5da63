"""``Collector(..., backend=...)``: one constructor for every place rollouts can run.

``Collector(...)`` hands every construction to :func:`construct` (``BaseCollector.__new__`` calls
``Collector._construct``). Calling :class:`~rlharvest.collectors.Collector` itself with ``backend``,
``backend_options``, ``num_collectors`` or ``sync`` builds the collector of that backend
(``"direct"`` = the in-process Collector, ``"process"`` = worker processes, ``"distributed"``,
``"rpc"``, ``"submitit"``, ``"ray"``) and returns it; subclasses of Collector refuse these four
arguments. Without ``backend``, an enclosing ``service_backend(...)`` context picks it (rlharvest's,
or TorchRL's). The rules are TorchRL 0.14's (docs/torchrl-compatibility.md).

The class of each backend is looked up by its public import path when ``Collector`` is called, as
TorchRL does: a class replaced there (``mock.patch``, a user's subclass) is the one built. Naming them
by path keeps the import graph acyclic: every collector built here imports ``Collector``, and this module
sits below ``Collector``.
"""

from __future__ import annotations

from typing import Any

from .._service_backend import current_service_backend
from .._utils import import_object

__all__ = ["BACKENDS", "TARGETS", "construct"]

#: backend names, and the spellings that mean the same
BACKENDS = ("direct", "process", "distributed", "rpc", "submitit", "ray")
_ALIASES = {"multiprocessing": "process", "threading": "thread"}
_SELECTORS = ("backend_options", "num_collectors", "num_workers", "sync")
#: the arguments only ``Collector`` itself takes
_DISPATCH_ARGUMENTS = ("backend", "backend_options", "num_collectors", "sync")

#: the collector each backend other than ``"direct"`` builds, by the import path read at each call
TARGETS = {
    "process": "rlharvest.collectors.multi:MultiCollector",
    "distributed": "rlharvest.collectors.distributed:DistributedCollector",
    "submitit": "rlharvest.collectors.distributed:DistributedCollector",
    "rpc": "rlharvest.collectors.distributed:RPCCollector",
    "ray": "rlharvest.collectors.distributed:RayCollector",
}


def construct(dispatcher: type, cls: type, args: tuple, kwargs: dict) -> Any:
    """What ``cls(*args, **kwargs)`` makes, for ``dispatcher`` (``Collector``) or a subclass of it: an
    instance of ``cls`` not yet initialised (Python calls its ``__init__`` next), or, for ``Collector``
    itself with another backend, a finished collector of that backend (then no ``__init__`` follows).

    Raises:
        TypeError, ValueError: for selector arguments that do not fit.
    """
    if cls is dispatcher:
        return _from_collector(cls, args, kwargs)
    if any(kwargs.get(name) is not None for name in _DISPATCH_ARGUMENTS):
        raise TypeError(f"{cls.__name__} takes no backend, backend_options, num_collectors or sync: only "
                        "Collector(...) itself dispatches on them.")
    return object.__new__(cls)


def _check_num_collectors(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_collectors must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"num_collectors must be a positive integer, got {value!r}")


def _backend_name(backend: Any, num_collectors: int | None) -> str:
    context = None
    if backend is None:
        backend, context = current_service_backend()
        if backend is None:
            return "process" if num_collectors is not None else "direct"
    name = _ALIASES.get(backend, backend) if isinstance(backend, str) else backend
    if name not in BACKENDS:
        where = f" (from the enclosing {context}.service_backend context)" if context else ""
        raise ValueError(f"backend must be one of {sorted(set(BACKENDS) | {'multiprocessing'})}, got "
                         f"{backend!r}{where}")
    return name


def _merged_options(options: dict | None, args: tuple, kwargs: dict) -> dict:
    options = dict(options or {})
    reserved = sorted(set(_SELECTORS) & set(options))
    if reserved:
        raise ValueError(f"backend_options holds the reserved selector key(s) {reserved}: pass them as arguments.")
    duplicates = set(options) & (set(kwargs) | set(("create_env_fn", "policy")[: len(args)]))
    if duplicates:
        raise ValueError(f"backend_options duplicate the collector argument(s) {sorted(duplicates)}.")
    return options


def _env_fns(args: tuple, kwargs: dict, num_collectors: int | None) -> tuple[tuple, dict, int]:
    """One env constructor per collector: a list fixes the count, a single one is repeated."""
    in_args = bool(args)
    env_fn = args[0] if in_args else kwargs.get("create_env_fn")
    if isinstance(env_fn, (list, tuple)):
        env_fns = list(env_fn)
        if not env_fns:
            raise ValueError("create_env_fn must hold at least one env constructor.")
        if num_collectors is not None and num_collectors != len(env_fns):
            raise ValueError(f"num_collectors={num_collectors} does not match the {len(env_fns)} env constructors "
                             "of create_env_fn.")
    else:
        env_fns = [env_fn] * (num_collectors or 1)
    if in_args:
        args = (env_fns, *args[1:])
    else:
        kwargs = {**kwargs, "create_env_fn": env_fns}
    return args, kwargs, len(env_fns)


def _from_collector(cls: type, args: tuple, kwargs: dict) -> Any:
    """``Collector(...)``: itself (``"direct"``), or the collector of the backend asked for."""
    backend, backend_options = kwargs.get("backend"), kwargs.get("backend_options")
    num_collectors, sync = kwargs.get("num_collectors"), kwargs.get("sync")
    if len(args) > 2:
        raise TypeError("Collector takes at most create_env_fn and policy positionally.")
    _check_num_collectors(num_collectors)
    name = _backend_name(backend, num_collectors)
    rest = {key: value for key, value in kwargs.items()
            if key not in _DISPATCH_ARGUMENTS}
    options = _merged_options(backend_options, args, rest)
    if name == "direct":
        if num_collectors not in (None, 1):
            raise ValueError(f"backend='direct' runs at most one collector, got num_collectors={num_collectors}.")
        if sync is not None:
            raise ValueError("sync only applies to collectors with workers (not backend='direct').")
        if options:
            raise ValueError("backend_options only apply to collectors with workers (not backend='direct').")
        return object.__new__(cls)  # Collector.__init__ follows, with these arguments
    if sync is not None and not isinstance(sync, bool):
        raise TypeError(f"sync must be True, False or None, got {sync!r}")
    rest = {**rest, **options}
    args, rest, count = _env_fns(args, rest, num_collectors)
    if name == "submitit":
        if rest.setdefault("launcher", "submitit") != "submitit":
            raise ValueError(f"backend='submitit' requires launcher='submitit', got {rest['launcher']!r}.")
    if name == "ray":
        rest["num_collectors"] = count
    return import_object(TARGETS[name])(*args, sync=bool(sync), **rest)
