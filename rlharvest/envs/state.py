"""An env's own state, captured for a collector's checkpoint and put back after it (docs/checkpoints.md).

What can be captured is decided by the env's *type* (never by poking a foreign object):

* rlharvest's envs (:class:`~rlharvest.envs.EnvBase`): their instance attributes, specs excepted
  (built from the constructor's arguments), through :meth:`EnvBase.capture_state`;
* :class:`~rlharvest.envs.GymEnv`: the same, plus every layer of the gymnasium wrapper chain (the
  unwrapped env's physics and ``np_random``, ``TimeLimit``'s step count, a ``SyncVectorEnv``'s
  sub-envs), when they can be deep-copied;
* batched envs whose sub-envs run behind a pool, and every foreign env: not captured. The caller
  restarts their episodes (with new trajectory ids) and names the env and the reason in one warning.

A captured state is a plain Python value (arrays, tensors, generators included) that ``pickle``
writes; the checkpoint stores it as bytes (``rlharvest/checkpoint.py``).
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

from .specs import TensorSpec

__all__ = ["EnvStateUnavailable", "instance_state", "restore_instance_state"]


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
