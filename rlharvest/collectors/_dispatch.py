"""``Collector(..., backend=...)`` and ``MultiCollector(..., sync=...)``: the one dispatch mechanism.

``BaseCollector.__new__`` hands every construction to :func:`construct`. Calling
:class:`~rlharvest.collectors.Collector` itself with ``backend``, ``backend_options``,
``num_collectors`` or ``sync`` builds the collector of that backend (``"direct"`` = the in-process
Collector, ``"process"`` = worker processes, ``"distributed"``, ``"rpc"``, ``"submitit"``, ``"ray"``)
and returns it; subclasses of Collector refuse these four arguments. ``MultiCollector(sync=...)``
builds a ``MultiSyncCollector`` (default) or a ``MultiAsyncCollector``. Without ``backend``, an
enclosing ``service_backend(...)`` context picks it (rlharvest's, or TorchRL's). The rules are TorchRL
0.14's (docs/torchrl-compatibility.md).

The public classes say which name they answer to (``BaseCollector.__init_subclass__(dispatch=...)``);
this module imports none of them.
"""

from __future__ import annotations

from typing import Any

from .._service_backend import current_service_backend

__all__ = ["BACKENDS", "construct", "register"]

#: backend names, and the spellings that mean the same
BACKENDS = ("direct", "process", "distributed", "rpc", "submitit", "ray")
_ALIASES = {"multiprocessing": "process", "threading": "thread"}
_SELECTORS = ("backend_options", "num_collectors", "num_workers", "sync")

#: ``{name: class}``: ``"direct"``, ``"process"`` (MultiCollector), ``"process-sync"``,
#: ``"process-async"``, ``"distributed"``, ``"rpc"``, ``"ray"``
_REGISTRY: dict[str, type] = {}


def register(name: str, cls: type) -> None:
    """``cls`` answers to ``name`` (called once per public class, at its definition)."""
    _REGISTRY[name] = cls


def construct(cls: type, args: tuple, kwargs: dict) -> Any:
    """What ``cls(*args, **kwargs)`` makes: an instance of ``cls`` not yet initialised (Python calls its
    ``__init__`` next), one of a subclass of it (likewise), or a finished collector of another class
    (then no ``__init__`` follows).

    Raises:
        TypeError, ValueError: for selector arguments that do not fit.
    """
    direct = _REGISTRY.get("direct")
    process = _REGISTRY.get("process")
    if cls is direct:
        return _from_collector(cls, args, kwargs)
    if direct is not None and issubclass(cls, direct):
        selectors = [kwargs.get(name) for name in ("backend", "backend_options", "num_collectors", "sync")]
        if any(value is not None for value in selectors):
            raise TypeError(f"{cls.__name__} takes no backend, backend_options, num_collectors or sync: only "
                            "Collector(...) itself dispatches on them.")
    if process is not None and issubclass(cls, process):
        return object.__new__(_process_class(cls, kwargs.get("sync")))
    return object.__new__(cls)


def _process_class(cls: type, sync: Any) -> type:
    """``MultiCollector`` picks by ``sync``; its subclasses check that ``sync`` does not contradict them."""
    if cls is _REGISTRY["process"]:
        return _REGISTRY["process-async" if sync is False else "process-sync"]
    own = issubclass(cls, _REGISTRY["process-sync"])
    if sync is not None and bool(sync) != own:
        raise TypeError(f"{cls.__name__} is {'' if own else 'a'}synchronous: sync={sync!r} contradicts it "
                        "(use MultiCollector(..., sync=...) to choose).")
    return cls


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
            if key not in ("backend", "backend_options", "num_collectors", "sync")}
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
        if "ray" not in _REGISTRY:
            raise ImportError("backend='ray' needs rlharvest's Ray support: pip install 'rlharvest[ray]'")
    target = _REGISTRY["distributed" if name == "submitit" else name]
    return target(*args, sync=bool(sync), **rest)
