"""Gymnasium environments (single and vectorised) behind rlharvest's env protocol."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import EnvBase
from .gym_vector import VectorResets, vector_resets
from .state import EnvStateUnavailable, instance_state, restore_instance_state
from .specs import Bounded, Categorical, Composite, OneHot, TensorSpec, Unbounded

__all__ = ["GymEnv"]


def _gymnasium():
    try:
        import gymnasium
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("GymEnv needs gymnasium: pip install 'rlharvest[gym]'") from err
    return gymnasium


def _space_to_spec(space, batch: tuple, categorical: bool) -> TensorSpec:
    spaces = _gymnasium().spaces
    if isinstance(space, spaces.Box):
        dtype = torch.from_numpy(np.zeros((), dtype=space.dtype)).dtype
        shape = (*batch, *space.shape)
        if np.all(np.isfinite(space.low)) and np.all(np.isfinite(space.high)):
            low = torch.as_tensor(np.asarray(space.low), dtype=dtype)
            high = torch.as_tensor(np.asarray(space.high), dtype=dtype)
            return Bounded(low, high, shape, dtype=dtype)
        return Unbounded(shape, dtype=dtype)
    if isinstance(space, spaces.Discrete):
        if categorical:
            return Categorical(int(space.n), shape=batch, dtype=torch.int64)
        return OneHot(int(space.n), shape=(*batch, int(space.n)), dtype=torch.int64)
    if isinstance(space, spaces.MultiDiscrete):
        return Categorical(int(np.max(space.nvec)), shape=(*batch, *space.shape), dtype=torch.int64)
    if isinstance(space, spaces.MultiBinary):
        return Unbounded((*batch, *np.shape(space.n)), dtype=torch.int8)
    raise TypeError(f"GymEnv does not support the gymnasium space {space!r}")


class GymEnv(EnvBase):
    """A gymnasium env (id or instance), or a gymnasium vector env as a batched env.

    Discrete actions are one-hot encoded by default (``action`` of shape ``(n,)``), as in TorchRL;
    ``categorical_action_encoding=True`` gives integer actions instead. Observations are stored
    under ``"observation"`` (a Dict observation space gives one key per entry). ``terminated`` and
    ``truncated`` are kept apart, ``done`` is their union.

    A vector env is driven in the autoreset mode it declares (``metadata["autoreset_mode"]``): every
    stored transition is a real step, and a sub-env whose episode ended starts afresh at its next
    step. A mode the env's type cannot give that in (``NEXT_STEP`` or ``DISABLED`` with a ``reset``
    that ignores ``options["reset_mask"]``, as gymnasium's ``CartPoleVectorEnv``) is refused here
    (docs/envs.md, "Gymnasium vector envs").

    Args:
        env: a gymnasium id (``"CartPole-v1"``), an ``Env`` or a ``VectorEnv`` instance.
        num_envs: with an id, build a synchronous vector env of this many copies (batch ``(n,)``).
        categorical_action_encoding: integer instead of one-hot discrete actions.
        **kwargs: forwarded to ``gymnasium.make`` when ``env`` is an id.

    Raises:
        ValueError: for a vector env whose autoreset mode rlharvest cannot drive right (the message
            names the mode and the fix).

    Example:
        >>> env = GymEnv("CartPole-v1")
        >>> env.set_seed(0)
        1
        >>> env.reset()["observation"].shape
        torch.Size([4])
    """

    def __init__(
        self,
        env: Any,
        *,
        num_envs: int | None = None,
        categorical_action_encoding: bool = False,
        **kwargs,
    ) -> None:
        super().__init__()
        gym = _gymnasium()
        if isinstance(env, str):
            if num_envs:
                mode = gym.vector.AutoresetMode.DISABLED
                env = gym.make_vec(env, num_envs=num_envs, vectorization_mode="sync",
                                   vector_kwargs={"autoreset_mode": mode}, **kwargs)
            else:
                env = gym.make(env, **kwargs)
        elif kwargs or num_envs:
            raise TypeError("num_envs and make() kwargs are only accepted with an env id.")
        self._vector = isinstance(env, gym.vector.VectorEnv)
        self._resets: VectorResets | None = (
            vector_resets(env, _gym_layers(env)[-1], gym) if self._vector else None
        )
        self._env = env
        self.batch_size = torch.Size([env.num_envs] if self._vector else [])
        obs_space = env.single_observation_space if self._vector else env.observation_space
        act_space = env.single_action_space if self._vector else env.action_space
        self._categorical = categorical_action_encoding or not isinstance(act_space, gym.spaces.Discrete)
        batch = tuple(self.batch_size)
        if isinstance(obs_space, gym.spaces.Dict):
            self._obs_keys = list(obs_space.spaces)
            obs_specs = {k: _space_to_spec(s, batch, True) for k, s in obs_space.spaces.items()}
        else:
            self._obs_keys = None
            obs_specs = {"observation": _space_to_spec(obs_space, batch, True)}
        self.observation_spec = Composite(obs_specs, shape=self.batch_size)
        self.full_action_spec = Composite(
            action=_space_to_spec(act_space, batch, categorical_action_encoding), shape=self.batch_size
        )
        self._obs_dtypes = {k: _np(spec.dtype) for k, spec in obs_specs.items()}
        self._obs_dtype = self._obs_dtypes.get("observation")
        self._act_space = act_space
        self._one_hot = isinstance(act_space, gym.spaces.Discrete) and not categorical_action_encoding
        self._discrete = isinstance(act_space, gym.spaces.Discrete)
        self._same_step = self._resets is not None and self._resets.same_step
        self.partial_reset = self._resets is None or self._resets.partial
        #: after a SAME_STEP step in which sub-envs ended: the observations the env reset them to
        self._autoreset_obs: dict | None = None
        self._autoreset_done: np.ndarray | None = None
        self._pending_seed: int | None = None

    @property
    def env(self):
        """The wrapped gymnasium env."""
        return self._env

    # ------------------------------------------------------------------ conversions
    def _convert_obs(self, obs) -> dict[str, torch.Tensor]:
        # a copy: the gymnasium env may hand out (and later overwrite) an array of its own
        if self._obs_keys is None:
            return {"observation": torch.from_numpy(np.array(obs, dtype=self._obs_dtype))}
        return {k: torch.from_numpy(np.array(obs[k], dtype=self._obs_dtypes[k])) for k in self._obs_keys}

    def _gym_action(self, action: torch.Tensor):
        # Read as TorchRL's GymEnv reads an action, whatever the policy wrote (docs/collection.md,
        # "Policies"): a one-hot by the index of its largest value once truncated to integers, the one
        # discrete action of one env as an int.
        if not self._vector:
            # One env's action of one number, or one-hot, read as Python numbers: ~1 us a step in the
            # rollout loop, against ~3 us for a numpy view of the tensor, whose making and freeing cost
            # more there than alone (docs/archive/performance-history.md, "The action handed to gymnasium").
            if self._one_hot:
                if action.dim() == 1:
                    values = action.tolist()
                    if action.is_floating_point():
                        values = [int(value) for value in values]
                    return values.index(max(values))  # the first largest, as argmax
            elif action.dim() == 0:
                return int(action.item()) if self._discrete else action.item()
        try:
            # a CPU tensor outside autograd shares its memory with numpy (~1 us): the policy's usual output
            array = action.numpy()
        except (RuntimeError, TypeError):  # it requires grad, or lives on another device
            array = action.detach().cpu().numpy()
        if self._one_hot:  # numpy's argmax costs ~0.3 us against ~2 us for a tiny torch tensor
            if array.dtype.kind == "f":
                array = array.astype(np.int64)
            index = array.argmax(-1) if array.ndim else np.zeros((), dtype=np.int64)
            return int(index) if not self._vector and index.size == 1 else index
        if not self._vector and array.ndim == 0:
            return array.item()
        return array

    # ------------------------------------------------------------------ array protocol
    def _reset_arrays(self, mask=None):
        seed, self._pending_seed = self._pending_seed, None
        if mask is not None and self._vector:
            mask = _mask_rows(mask)
            current, fresh = self._autoreset_obs, self._autoreset_done
            self._autoreset_obs = self._autoreset_done = None
            if current is not None:  # a SAME_STEP env already reset the sub-envs that ended
                mask = mask & ~fresh
                if not mask.any():
                    return current
                if not mask.all() and not self._resets.partial and (mask | fresh).all():
                    mask = None  # resetting those again too is the only way to reset the others
            if mask is not None and not mask.all():
                if not self._resets.partial:
                    raise RuntimeError(self._no_partial_reset(mask))
                obs, _ = self._env.reset(seed=seed, options={"reset_mask": mask})
                return self._convert_obs(obs)
        obs, _ = self._env.reset(seed=seed)
        self._autoreset_obs = self._autoreset_done = None
        return self._convert_obs(obs)

    def _no_partial_reset(self, mask: np.ndarray) -> str:
        return (f"{self!r} cannot reset sub-envs {np.flatnonzero(mask).tolist()} alone: "
                f"{self._resets.why_not_partial}. Its episodes end by themselves (autoreset mode "
                f"{self._resets.mode}); a collector resets other sub-envs only for max_frames_per_traj: "
                "give the env a time limit of its own (max_episode_steps) instead.")

    def _step_arrays(self, actions):
        obs, reward, terminated, truncated, info = self._env.step(self._gym_action(actions["action"]))
        self._autoreset_obs = self._autoreset_done = None
        if not self._vector:
            return self._convert_obs(obs), float(reward), bool(terminated), bool(truncated)
        terminated = np.asarray(terminated, dtype=np.bool_).reshape(-1, 1)
        truncated = np.asarray(truncated, dtype=np.bool_).reshape(-1, 1)
        reward = np.asarray(reward, dtype=np.float32).reshape(-1, 1)
        if self._same_step and "final_obs" in info:
            self._autoreset_done = np.asarray(info["_final_obs"], dtype=np.bool_)
            if self._obs_keys is None:  # one array: the ended rows' final observations put in at once
                self._autoreset_obs = self._convert_obs(obs)
                patched = np.array(obs, dtype=self._obs_dtype)
                rows = np.flatnonzero(self._autoreset_done)
                if rows.size:
                    patched[rows] = np.stack([info["final_obs"][row] for row in rows])
                return {"observation": torch.from_numpy(patched)}, reward, terminated, truncated
            next_obs = self._convert_obs(obs)
            self._autoreset_obs = {k: v.clone() for k, v in next_obs.items()}
            for row in np.flatnonzero(self._autoreset_done):
                for key, value in self._convert_obs(info["final_obs"][row]).items():
                    next_obs[key][row] = value
            return next_obs, reward, terminated, truncated
        return self._convert_obs(obs), reward, terminated, truncated

    def _set_seed(self, seed: int) -> None:
        self._pending_seed = seed
        self._act_space.seed(seed)

    # ------------------------------------------------------------------ state (docs/checkpoints.md)
    def capture_state(self) -> dict[str, Any]:
        """This wrapper's state and that of every layer of the gymnasium env: the wrappers' (a time
        limit's step count...) and the unwrapped env's (its physics, ``np_random``); a
        ``SyncVectorEnv``'s sub-envs whole.

        Raises:
            EnvStateUnavailable: naming the layer whose state cannot be copied (e.g. an
                ``AsyncVectorEnv``'s processes).
        """
        return {"own": instance_state(self, skip=("_env",)), "layers": capture_gym_layers(self._env)}

    def restore_state(self, state: dict[str, Any]) -> None:
        restore_gym_layers(self._env, state["layers"])  # checks the layers first
        restore_instance_state(self, state["own"])

    def close(self, *, raise_if_closed: bool = True) -> None:
        if not self.is_closed:
            self._env.close()
        super().close(raise_if_closed=raise_if_closed)

    def __repr__(self) -> str:
        spec = getattr(self._env, "spec", None)
        name = spec.id if spec is not None else type(self._env).__name__
        return f"GymEnv({name!r}, batch_size={tuple(self.batch_size)})"


def capture_gym_layers(env) -> list[dict[str, Any]]:
    """The state of every layer of the gymnasium env ``env`` (wrappers, then the unwrapped env).

    Raises:
        EnvStateUnavailable: naming the layer whose state cannot be copied.
    """
    layers = []
    for layer in _gym_layers(env):
        try:
            layers.append(instance_state(layer, skip=("env", "env_fns")))
        except EnvStateUnavailable as err:
            raise EnvStateUnavailable(f"gymnasium layer {type(layer).__name__}: {err}") from None
    return layers


def restore_gym_layers(env, states: list[dict[str, Any]]) -> None:
    """Put what :func:`capture_gym_layers` returned back into ``env``.

    Raises:
        EnvStateUnavailable: when ``env`` has other layers than the captured one.
    """
    layers = _gym_layers(env)
    if len(layers) != len(states):
        raise EnvStateUnavailable(f"the checkpoint's gymnasium env has {len(states)} layers, this one "
                                  f"{len(layers)} ({' > '.join(type(layer).__name__ for layer in layers)})")
    for layer, layer_state in zip(layers, states):
        restore_instance_state(layer, layer_state)


def _gym_layers(env) -> list:
    """The wrappers of a gymnasium env, outermost first, then the unwrapped env."""
    gym = _gymnasium()
    layers = [env]
    while isinstance(layers[-1], (gym.Wrapper, gym.vector.VectorWrapper)):
        layers.append(layers[-1].env)
    return layers


def _np(dtype: torch.dtype):
    return torch.empty((), dtype=dtype).numpy().dtype


def _mask_rows(mask) -> np.ndarray:
    """The rows to reset as a flat numpy bool array: the rollout's done rows (a CPU bool tensor) as a
    view, ~1 us where the general conversion takes ~5."""
    if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and mask.dtype == torch.bool:
        return mask.reshape(-1).numpy()
    return np.asarray(torch.as_tensor(mask).reshape(-1).cpu(), dtype=np.bool_)
