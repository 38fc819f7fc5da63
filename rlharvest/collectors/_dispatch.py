"""``Collector(..., backend=...)``: one constructor for every place rollouts can run.

Calling :class:`~rlharvest.collectors.Collector` itself with ``backend``, ``backend_options``,
``num_collectors`` or ``sync`` builds the collector of that backend (``"direct"`` = the in-process
Collector, ``"process"`` = worker processes, ``"distributed"``, ``"rpc"``, ``"submitit"``) and returns
it; subclasses and the concrete collectors refuse these four arguments. Without ``backend``, an
enclosing ``service_backend(...)`` context picks it (rlharvest's, or TorchRL's). The rules are TorchRL
0.14's (docs/torchrl-compatibility.md).
"""

from __future__ import annotations

import inspect
from typing import Any

from .._service_backend import current_service_backend

__all__ = ["BackendDispatch", "BACKENDS"]

#: backend names, and the spellings that mean the same
BACKENDS = ("direct", "process", "distributed", "rpc", "submitit", "ray")
_ALIASES = {"multiprocessing": "process", "threading": "thread"}
_SELECTORS = ("backend_options", "num_collectors", "num_workers", "sync")


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


def _direct_env_fn(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    in_args = bool(args)
    env_fn = args[0] if in_args else kwargs.get("create_env_fn")
    if not isinstance(env_fn, (list, tuple)):
        return args, kwargs
    if len(env_fn) != 1:
        raise ValueError(f"backend='direct' needs exactly one env constructor, got {len(env_fn)}.")
    if in_args:
        return (env_fn[0], *args[1:]), kwargs
    return args, {**kwargs, "create_env_fn": env_fn[0]}


def _target(backend: str):
    if backend == "process":
        from .multi import MultiCollector

        return MultiCollector
    if backend == "rpc":
        from .distributed import RPCCollector

        return RPCCollector
    if backend == "ray":
        try:
            from .distributed import RayCollector
        except ImportError as err:  # the Ray backend lives in the optional extra
            raise ImportError("backend='ray' needs rlharvest's Ray support: pip install 'rlharvest[ray]'") from err
        return RayCollector
    from .distributed import DistributedCollector

    return DistributedCollector


class BackendDispatch(type):
    """Metaclass of Collector: ``Collector(...)`` with a backend selector builds that backend's collector."""

    @property
    def __signature__(cls):
        signature = inspect.signature(cls.__init__)
        parameters = list(signature.parameters.values())[1:]
        if cls.__name__ == "Collector" and cls.__module__.endswith("collectors.single"):
            keyword = inspect.Parameter.KEYWORD_ONLY
            selectors = [inspect.Parameter(name, keyword, default=None)
                         for name in ("backend", "backend_options", "num_collectors", "sync")]
            variadic = [p for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
            parameters = [p for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD] + selectors + variadic
        return signature.replace(parameters=parameters)

    def __call__(cls, *args, backend=None, backend_options=None, num_collectors=None, sync=None, **kwargs):
        from .single import Collector

        selectors = (backend, backend_options, num_collectors, sync)
        if cls is not Collector:
            if any(value is not None for value in selectors):
                raise TypeError(f"{cls.__name__} takes no backend, backend_options, num_collectors or sync: only "
                                "Collector(...) itself dispatches on them.")
            return super().__call__(*args, **kwargs)
        if len(args) > 2:
            raise TypeError("Collector takes at most create_env_fn and policy positionally.")
        _check_num_collectors(num_collectors)
        name = _backend_name(backend, num_collectors)
        options = _merged_options(backend_options, args, kwargs)
        if name == "direct":
            if num_collectors not in (None, 1):
                raise ValueError(f"backend='direct' runs at most one collector, got num_collectors={num_collectors}.")
            if sync is not None:
                raise ValueError("sync only applies to collectors with workers (not backend='direct').")
            if options:
                raise ValueError("backend_options only apply to collectors with workers (not backend='direct').")
            args, kwargs = _direct_env_fn(args, kwargs)
            return super().__call__(*args, **kwargs)
        if sync is not None and not isinstance(sync, bool):
            raise TypeError(f"sync must be True, False or None, got {sync!r}")
        kwargs = {**kwargs, **options}
        args, kwargs, count = _env_fns(args, kwargs, num_collectors)
        if name == "submitit":
            if kwargs.setdefault("launcher", "submitit") != "submitit":
                raise ValueError(f"backend='submitit' requires launcher='submitit', got {kwargs['launcher']!r}.")
        if name == "ray":
            kwargs["num_collectors"] = count
        return _target(name)(*args, sync=bool(sync), **kwargs)
