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

The entry points :func:`~rlharvest.envs.capture.capture_env_state` and
:func:`~rlharvest.envs.capture.restore_env_state` (collectors call them for their env, batched envs
for each sub-env) live in ``capture.py``, above the env types they know; this module holds what every
env uses (instance attributes, the process's generators).

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

__all__ = ["EnvStateUnavailable", "instance_state", "restore_instance_state", "type_name",
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
