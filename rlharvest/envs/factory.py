"""Building envs from what collectors are given (an env or a factory, see docs/envs.md), and the
few questions collectors ask of an env they built."""

from __future__ import annotations

import sys
from typing import Any

from .._utils import as_tuple_key, unwrap
from .adapters import env_attr, is_env

__all__ = ["make_env", "env_keys", "close_env", "GYMNASIUM_ADVICE", "gymnasium_instance"]


def gymnasium_instance(value: Any) -> bool:
    """Whether ``value`` is a gymnasium (or gym) env instance, by its type: an env of another library,
    which collectors take wrapped in ``GymEnv``, or built by a factory."""
    for package in ("gymnasium", "gym"):
        module = sys.modules.get(package)  # only loaded when such an env exists
        bases = (getattr(module, "Env", None), getattr(getattr(module, "vector", None), "VectorEnv", None))
        if module is not None and any(isinstance(base, type) and isinstance(value, base) for base in bases):
            return True
    return False


#: what to do with a gymnasium env instance (the end of a message)
GYMNASIUM_ADVICE = ("wrap it in GymEnv (GymEnv(env)), or pass a factory that builds it "
                    "(e.g. lambda: GymEnv(\"CartPole-v1\"))")


def make_env(create_env_fn: Any, create_env_kwargs: dict | None):
    """An env from an instance or a constructor (docs/envs.md: kwargs reach an instance only if it is batched)."""
    create_env_fn = unwrap(create_env_fn)
    kwargs = create_env_kwargs or {}
    if is_env(create_env_fn):
        if kwargs:
            if not create_env_fn.batch_size or env_attr(create_env_fn, "update_kwargs") is None:
                raise RuntimeError(
                    f"create_env_kwargs were given with an env instance ({type(create_env_fn).__name__}); "
                    "they can only be forwarded to a batched env. Pass a constructor instead."
                )
            create_env_fn.update_kwargs(kwargs)
        return create_env_fn
    if gymnasium_instance(create_env_fn):
        raise TypeError(f"create_env_fn is a gymnasium env ({type(create_env_fn).__name__}), not an env of rlharvest: "
                        f"{GYMNASIUM_ADVICE}.")
    if not callable(create_env_fn):
        raise TypeError(f"create_env_fn must be an env or a callable returning one, got {type(create_env_fn).__name__}")
    env = create_env_fn(**kwargs)
    if gymnasium_instance(env):
        raise TypeError(f"create_env_fn returned a gymnasium env ({type(env).__name__}), which is not an env of "
                        "rlharvest: return it wrapped in GymEnv (GymEnv(env)) (docs/envs.md).")
    if not is_env(env):
        raise TypeError(f"create_env_fn returned {type(env).__name__}, which is not an env (docs/envs.md).")
    return env


def env_keys(env) -> set:
    """Every key of the env's observation and state specs, as tuples."""
    keys = set()
    for name in ("observation_spec", "full_observation_spec", "full_state_spec"):
        spec = env_attr(env, name)
        if spec is not None and hasattr(spec, "keys"):
            keys |= {as_tuple_key(k) for k in spec.keys(True, True)}
    return keys


def close_env(env) -> None:
    """Close the env unless it already is (envs that do not take ``raise_if_closed`` too)."""
    if env_attr(env, "is_closed", False):
        return
    try:
        env.close(raise_if_closed=False)
    except TypeError:
        env.close()
