"""Reconfiguring an env while it runs: an attribute read or set, a method called, at a dotted path into
the env (``"env.unwrapped.gravity"`` reaches the gymnasium env a ``GymEnv`` wraps). A batched env of
rlharvest's (``SerialEnv``, ``ParallelEnv``) does it in each of its sub-envs, where each runs
(docs/collection.md, "Reconfiguring running envs").

The collectors' ``setattr_env``, ``call_env`` and ``getattr_env`` come down to :func:`reconfigure_env`
in the process that holds the env; a sub-env process runs the same function on its own env.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._utils import resolve_attr_path

__all__ = ["EnvOpKind", "EnvOp", "SubEnvsReconfigurable", "reconfigure_env", "apply_env_op"]


class EnvOpKind(str, enum.Enum):
    """What an :class:`EnvOp` does at its path."""

    GET = "get"
    SET = "set"
    CALL = "call"


@dataclass(frozen=True)
class EnvOp:
    """One reconfiguration of an env: read, set or call what ``path`` names.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> env = CountingEnv(max_steps=5)
        >>> reconfigure_env(env, EnvOp(EnvOpKind.SET, "max_steps", 7))
        >>> reconfigure_env(env, EnvOp(EnvOpKind.GET, "max_steps"))
        7
    """

    kind: EnvOpKind
    path: str
    value: Any = None
    """The value to set (``SET``)."""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"name must be a non-empty attribute path (a str), got {self.path!r}.")


class SubEnvsReconfigurable(Protocol):
    """A batched env whose sub-envs each take the op where they run (``BatchedEnvBase``): an env whose
    class has ``reconfigure_sub_envs``."""

    def reconfigure_sub_envs(self, op: EnvOp) -> list[Any]:
        """The op applied to each sub-env; their results, in sub-env order."""


def _owner_and_name(env: Any, path: str) -> tuple[Any, str]:
    """The object holding the last attribute of ``path``, and that attribute's name.

    Raises:
        ValueError: when the last segment of ``path`` is not a plain attribute name.
        AttributeError: naming the missing segment.
    """
    head, _, name = path.rpartition(".")
    if not name.isidentifier():
        raise ValueError(f"{path!r}: setattr_env sets an attribute; end the path with its name.")
    return (resolve_attr_path(env, head) if head else env), name


def apply_env_op(env: Any, op: EnvOp) -> Any:
    """``op`` applied to ``env`` itself (not to sub-envs).

    Raises:
        AttributeError: for a path that does not resolve, or an attribute to set that ``env`` lacks
            (``setattr_env`` changes what the env has: a misspelt name is not added silently).
        TypeError: calling what is not callable.
    """
    if op.kind is EnvOpKind.GET:
        return resolve_attr_path(env, op.path)
    if op.kind is EnvOpKind.CALL:
        method = resolve_attr_path(env, op.path)
        if not callable(method):
            raise TypeError(f"{op.path!r} of {type(env).__name__} is a {type(method).__name__}, not a method.")
        return method(*op.args, **op.kwargs)
    owner, name = _owner_and_name(env, op.path)
    if not hasattr(owner, name):
        raise AttributeError(f"{type(owner).__name__} has no attribute {name!r} (path {op.path!r}): setattr_env sets "
                             "an attribute the env has.")
    setattr(owner, name, op.value)
    return None


def reconfigure_env(env: Any, op: EnvOp) -> Any:
    """``op`` applied to ``env``; a batched env of rlharvest's applies a ``SET`` in each sub-env, and a
    ``GET`` or ``CALL`` that it does not resolve itself in each sub-env (then a list, one entry per
    sub-env).

    Raises:
        AttributeError, TypeError, ValueError: see :func:`apply_env_op`.
    """
    if not callable(getattr(type(env), "reconfigure_sub_envs", None)):  # not a SubEnvsReconfigurable
        return apply_env_op(env, op)
    if op.kind is not EnvOpKind.SET:
        try:
            return apply_env_op(env, op)
        except AttributeError:
            pass
    results = env.reconfigure_sub_envs(op)
    return None if op.kind is EnvOpKind.SET else results
