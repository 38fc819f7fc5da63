"""Capturing an env's state for a checkpoint, and putting it back (docs/checkpoints.md): what can be
captured is decided by the env's type (``state.py`` says which). Above the env types it knows:
rlharvest's :class:`~rlharvest.envs.EnvBase`, and the gymnasium layers of a :class:`~rlharvest.envs.GymEnv`
or of TorchRL's ``GymEnv``/``GymWrapper``."""

from __future__ import annotations

from typing import Any

from .base import EnvBase
from .gym import capture_gym_layers, restore_gym_layers
from .state import EnvStateUnavailable, type_name

__all__ = ["capture_env_state", "restore_env_state"]


def capture_env_state(env: Any) -> dict[str, Any]:
    """The state of ``env`` (its type and its :meth:`~rlharvest.envs.EnvBase.capture_state`).

    Raises:
        EnvStateUnavailable: for an env whose state cannot be captured, saying why.
    """
    if isinstance(env, EnvBase):
        return {"type": type_name(env), "state": env.capture_state()}
    if _is_torchrl_gym(env):
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
        restore_gym_layers(vars(env)["_env"], captured["torchrl_gym_layers"])
        return
    env.restore_state(captured["state"])
