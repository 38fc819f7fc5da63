"""Signatures of collectors that take their parent's arguments plus (or minus) a few of their own.

TorchRL users read signatures (``inspect.signature``, IDEs, ``help``), so every public collector
shows every parameter; a subclass that only adds or removes a few builds its signature from its
parent's instead of listing them all again, and checks its calls against it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Mapping

__all__ = ["derived_signature", "bind_arguments", "method_signature", "keyword"]


def derived_signature(parent: Callable, *, drop: Iterable[str] = (), defaults: Mapping[str, Any] | None = None,
                      add: Iterable[inspect.Parameter] = (), after: str | None = None) -> inspect.Signature:
    """The parameters of ``parent`` (a constructor; ``self`` left out), minus ``drop``, with new
    ``defaults``, and with ``add`` inserted after the parameter named ``after`` (else at the end).

    Example:
        >>> def parent(self, a, *, b=1, c=2): ...
        >>> str(derived_signature(parent, drop=["c"], defaults={"b": 5}))
        '(a, *, b=5)'
    """
    drop, defaults = set(drop), dict(defaults or {})
    params = [p.replace(default=defaults.get(name, p.default)) for name, p in inspect.signature(parent).parameters.items()
              if name != "self" and name not in drop]
    index = next(i for i, p in enumerate(params) if p.name == after) + 1 if after is not None else len(params)
    params[index:index] = list(add)
    return inspect.Signature(params)


def bind_arguments(owner: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call to ``owner``, defaults filled in.

    Raises:
        TypeError: for a call the signature does not accept (an unknown keyword argument names it).
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{owner}() {err}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def keyword(name: str, default: Any = None, annotation: Any = inspect.Parameter.empty) -> inspect.Parameter:
    """A keyword-only parameter."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def method_signature(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with a leading ``self``: what ``inspect.signature(cls.__init__)`` shows (TorchRL's
    tests and users compare constructors that way, not only through the class)."""
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[this, *signature.parameters.values()])


def constructor_arguments(frame_locals: Mapping[str, Any]) -> dict[str, Any]:
    """A constructor's arguments from its ``locals()`` taken first thing (``self`` left out), to be
    parsed at once into the collector's typed options."""
    return {name: value for name, value in frame_locals.items() if name not in ("self", "__class__")}
