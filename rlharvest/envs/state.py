"""An env's own state, captured for a collector's checkpoint and put back after it (docs/checkpoints.md).

What can be captured is decided by the env's *type* (never by poking a foreign object):

* rlharvest's envs (:class:`~rlharvest.envs.EnvBase`): their instance attributes, specs excepted
  (built from the constructor's arguments), through :meth:`EnvBase.capture_state`;
* :class:`~rlharvest.envs.GymEnv`: the same, plus every layer of the gymnasium wrapper chain (the
  unwrapped env's physics and ``np_random``, ``TimeLimit``'s step count, a ``SyncVectorEnv``'s
  sub-envs), when they can be deep-copied;
* :class:`~rlharvest.envs.SerialEnv` and :class:`~rlharvest.envs.ParallelEnv`: every sub-env's state
  (asked of the sub-env where it runs, its process's global generators included for ParallelEnv)
  and the batched env's own bookkeeping;
* TorchRL's ``GymEnv``/``GymWrapper`` (told by their exact type): the layers of the gymnasium env
  they wrap;
* every other foreign env: not captured. The caller restarts its episodes (with new trajectory ids)
  and names the env and the reason in one warning.

:func:`capture_env_state` and :func:`restore_env_state` are the entry points (collectors call them
for their env, batched envs for each sub-env).

A captured state is a plain Python value (arrays, tensors, generators included) that ``pickle``
writes; the checkpoint stores it as bytes (``rlharvest/checkpoint.py``).
"""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any

import numpy as np
import torch

from .specs import TensorSpec

__all__ = ["EnvStateUnavailable", "capture_env_state", "restore_env_state", "instance_state", "restore_instance_state",
           "process_generators", "restore_process_generators"]


class EnvStateUnavailable(Exception):
    """The env's state cannot be captured (or restored); the message says why."""


def _is_spec(value: Any) -> bool:
    return isinstance(value, TensorSpec) or type(value).__name__ == "Composite"


def instance_state(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A deep copy of ``obj``'s instance attributes (specs and ``skip`` left out).

    Raises:
        EnvStateUnavailable: naming the attribute that cannot be copied or pickled.
    """
    state = {}
    for name, value in vars(obj).items():
        if name in skip or _is_spec(value):
            continue
        try:
            copied = copy.deepcopy(value)
            pickle.dumps(copied)
        except Exception as err:  # a lock, a process, an open file, a socket...
            raise EnvStateUnavailable(f"its attribute {name!r} ({type(value).__name__}) cannot be copied: "
                                      f"{type(err).__name__}: {err}") from None
        state[name] = copied
    return state


def restore_instance_state(obj: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`instance_state` captured (a copy: the checkpoint stays reusable)."""
    vars(obj).update(copy.deepcopy(state))


def type_name(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s type: what a captured state records and is checked against."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def capture_env_state(env: Any) -> dict[str, Any]:
    """The state of ``env`` (its type and its :meth:`~rlharvest.envs.EnvBase.capture_state`).

    Raises:
        EnvStateUnavailable: for an env whose state cannot be captured, saying why.
    """
    from .base import EnvBase

    if isinstance(env, EnvBase):
        return {"type": type_name(env), "state": env.capture_state()}
    if _is_torchrl_gym(env):
        from .gym import capture_gym_layers

        return {"type": type_name(env), "torchrl_gym_layers": capture_gym_layers(env._env)}
    raise EnvStateUnavailable(f"it is a {type_name(env)}, not an rlharvest env (rlharvest captures the state of its "
                              "own envs, of gymnasium envs through GymEnv, and of TorchRL's GymEnv/GymWrapper "
                              "without transforms)")


#: TorchRL's envs whose whole stepping state is the gymnasium env they wrap (in ``_env``)
_TORCHRL_GYM = {"torchrl.envs.libs.gym.GymEnv", "torchrl.envs.libs.gym.GymWrapper"}


def _is_torchrl_gym(env: Any) -> bool:
    """A TorchRL GymEnv or GymWrapper, told by its exact type (never by calling its members)."""
    return type_name(env) in _TORCHRL_GYM and hasattr(env, "__dict__") and "_env" in vars(env)


def restore_env_state(env: Any, captured: dict[str, Any]) -> None:
    """Put what :func:`capture_env_state` returned back into ``env``.

    Raises:
        EnvStateUnavailable: when ``env`` is not of the type the state was captured from.
    """
    if captured["type"] != type_name(env):
        raise EnvStateUnavailable(f"the checkpoint holds the state of a {captured['type']}, this env is a "
                                  f"{type_name(env)}")
    if "torchrl_gym_layers" in captured:
        from .gym import restore_gym_layers

        restore_gym_layers(vars(env)["_env"], captured["torchrl_gym_layers"])
        return
    env.restore_state(captured["state"])


def process_generators() -> dict[str, Any]:
    """This process's global generators (torch's, numpy's legacy one, Python's), as plain values.

    A ParallelEnv sub-env process has its own (seeded at start and by ``set_seed``), and sub-envs
    may draw from them (noise, ``CountingEnv``'s seed): its state includes them.
    """
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_process_generators(state: dict[str, Any]) -> None:
    """Put back what :func:`process_generators` captured."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
