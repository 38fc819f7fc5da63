"""How :class:`~rlharvest.envs.GymEnv` resets the sub-envs of a gymnasium vector env.

The rollout resets a sub-env whose episode ended before that sub-env's next step, and nothing else
(docs/envs.md, "What a collected frame means"). A gymnasium vector env declares in
``metadata["autoreset_mode"]`` what it does itself when a sub-env ends:

* ``SAME_STEP``: ``step()`` resets it at once and returns its last observation in
  ``info["final_obs"]``; nothing is left for rlharvest to reset.
* ``DISABLED``: nothing; rlharvest resets the ended sub-envs with
  ``reset(options={"reset_mask": ended})``.
* ``NEXT_STEP``: its next ``step()`` is a reset that ignores the action. rlharvest resets the ended
  sub-envs with a masked reset first, which clears that pending reset, so every step is a real one.

A masked reset is only right when the env's ``reset`` resets the masked sub-envs alone. That is read
from the env's type, never by calling it (docs/envs.md, "Gymnasium vector envs"); what cannot be
made right is refused when the ``GymEnv`` is built, with the fix in the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["VectorResets", "vector_resets"]


@dataclass(frozen=True)
class VectorResets:
    """What :class:`GymEnv` relies on when sub-envs of a vector env end (or are truncated by a collector)."""

    mode: str
    """The env's autoreset mode: ``"SAME_STEP"``, ``"NEXT_STEP"`` or ``"DISABLED"``."""
    same_step: bool
    """``step()`` resets an ended sub-env itself, its last observation in ``info["final_obs"]``."""
    partial: bool
    """``reset(options={"reset_mask": m})`` resets the sub-envs of ``m`` alone."""
    why_not_partial: str = ""
    """When ``partial`` is False: why (for error messages)."""


def vector_resets(env: Any, base: Any, gym: Any) -> VectorResets:
    """How the vector env ``env`` (whose innermost, unwrapped env is ``base``) can be reset.

    Raises:
        ValueError: when GymEnv cannot reset an ended sub-env alone before its next step (a
            ``NEXT_STEP`` or ``DISABLED`` env whose reset ignores ``reset_mask``), or the env does
            not say which autoreset mode it follows; the message names the mode and the fix.
    """
    mode = _autoreset_mode_name(env, gym)
    partial, why_not = _partial_reset(base, gym, mode)
    resets = VectorResets(mode or "", mode == "SAME_STEP", partial, why_not)
    if mode is None:
        raise ValueError(
            f"GymEnv cannot tell how {_name(base)} resets a sub-env whose episode ended: its "
            f"metadata['autoreset_mode'] is {env.metadata.get('autoreset_mode')!r}, not a "
            "gymnasium.vector.AutoresetMode. Fix: set metadata['autoreset_mode'] to the mode its step() follows.")
    if mode == "SAME_STEP" or partial:
        return resets
    if mode == "NEXT_STEP":
        what = ("spends the step after an episode's end on a reset that ignores the action, and rlharvest "
                "avoids that step (it is no transition) by resetting the ended sub-env alone first")
    else:
        what = ("leaves an ended sub-env for its user to reset, and rlharvest must reset it alone (the "
                "others are mid-episode)")
    raise ValueError(f"GymEnv cannot drive {_name(base)} in autoreset mode {mode}: such an env {what}, "
                     f"but {why_not}. Fix: {_fix(env, base, gym)}.")


def _autoreset_mode_name(env: Any, gym: Any) -> str | None:
    """The name of ``env``'s ``metadata["autoreset_mode"]`` (an ``AutoresetMode``, its value or its
    name), or None when it has none or an unknown one."""
    modes = gym.vector.AutoresetMode
    declared = env.metadata.get("autoreset_mode")
    if isinstance(declared, modes):
        return declared.name
    for mode in modes:
        if declared in (mode.value, mode.name, str(mode)):
            return mode.name
    return None


def _partial_reset(base: Any, gym: Any, mode: str | None) -> tuple[bool, str]:
    """Whether ``base``'s reset resets the sub-envs of ``options["reset_mask"]`` alone (and why not).

    Gymnasium's ``SyncVectorEnv`` and ``AsyncVectorEnv`` do; another class does when its ``reset``
    reads ``"reset_mask"`` (the name is a constant of the method's code: nothing is called). Vector
    wrappers pass ``options`` on to the env they wrap, so the unwrapped env decides.
    """
    cls = type(base)
    reset = getattr(cls, "reset", None)
    vector = gym.vector
    if isinstance(base, vector.AsyncVectorEnv) and reset is vector.AsyncVectorEnv.reset:
        if mode == "NEXT_STEP" and not vars(base).get("shared_memory", True):
            return False, ("AsyncVectorEnv(shared_memory=False) keeps the sub-env's pending reset through "
                           "reset(options={'reset_mask': ...})")
        return True, ""
    if isinstance(base, vector.SyncVectorEnv) and reset is vector.SyncVectorEnv.reset:
        return True, ""
    code = getattr(reset, "__code__", None)
    if code is not None and "reset_mask" in code.co_consts:
        return True, ""
    return False, f"{cls.__qualname__}.reset() does not read options['reset_mask'] (it resets every sub-env)"


def _name(base: Any) -> str:
    spec = getattr(base, "spec", None)
    kind = type(base).__name__
    return f"{kind} ({spec.id})" if getattr(spec, "id", None) else kind


def _fix(env: Any, base: Any, gym: Any) -> str:
    if isinstance(base, gym.vector.AsyncVectorEnv):
        return ("AsyncVectorEnv(..., shared_memory=True) (the default; with make_vec, "
                "vector_kwargs={'shared_memory': True}), or autoreset_mode SAME_STEP or DISABLED")
    spec = getattr(base, "spec", None)
    env_id = getattr(spec, "id", None)
    if env_id is None:
        return ("give it autoreset_mode SAME_STEP, or vectorize the env with gymnasium's SyncVectorEnv or "
                "AsyncVectorEnv (any autoreset mode)")
    num_envs = env.num_envs
    return (f"gym.make_vec({env_id!r}, num_envs={num_envs}, vectorization_mode='sync' (or 'async'), "
            "vector_kwargs={'autoreset_mode': gym.vector.AutoresetMode.SAME_STEP}) (or DISABLED), "
            f"or GymEnv({env_id!r}, num_envs={num_envs})")
