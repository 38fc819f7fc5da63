"""Deterministic envs and policies shared by the tests (importable: tests/ is on the pytest path)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule

from rlharvest.envs import Composite, ContinuousMockEnv, CountingEnv, Unbounded
from rlharvest.envs.specs import Binary


def wait_until(condition, timeout: float = 30.0, what: str | Callable[[], str] = "the condition") -> None:
    """Poll ``condition()`` until it holds; fail the test after ``timeout`` seconds (never hang).

    ``what`` names what is awaited in the failure message; a callable is asked at the time of failure
    (e.g. to list the processes still alive).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what() if callable(what) else what} did not happen within {timeout:g} s")
        time.sleep(0.01)


class CountingPolicy(torch.nn.Module):
    """One scalar parameter ``weight`` (init 1.0); writes ``action = weight`` broadcast: actions show the weights."""

    def __init__(self, weight: float = 1.0, action_key="action") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(float(weight)))
        self.action_key = action_key

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        shape = (*tensordict.batch_size, 1)
        tensordict.set(self.action_key, self.weight.detach().expand(shape).clone())
        return tensordict


class BiasPolicy(torch.nn.Module):
    """action = bias (a parameter), as a key-to-key module usable on the fast path."""

    def __init__(self, bias: float = 0.0) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor([float(bias)]))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(observation, dtype=torch.float32) + self.bias


def bias_policy(bias: float = 0.0) -> TensorDictModule:
    return TensorDictModule(BiasPolicy(bias), in_keys=["observation"], out_keys=["action"])


class TorchRLStyleCountingEnv:
    """A CountingEnv written against the TensorDict protocol only (no rlharvest base class).

    Has exactly the members of the env protocol (docs/envs.md), like a TorchRL ``EnvBase`` would, so it goes through the
    collectors' general TensorDict path. ``with_step_and_maybe_reset=False`` removes that method.
    """

    def __init__(self, max_steps: int = 5, batch_size=(), with_step_and_maybe_reset: bool = True) -> None:
        self.max_steps = max_steps
        self.batch_size = torch.Size(batch_size)
        self.device = torch.device("cpu")
        shape = (*self.batch_size, 1)
        self.observation_spec = Composite(observation=Unbounded(shape, dtype=torch.int32), shape=self.batch_size)
        self.full_action_spec = Composite(action=Binary(shape=shape, dtype=torch.int8), shape=self.batch_size)
        self.action_keys = ["action"]
        self.done_keys = ["done", "terminated"]
        self.reward_keys = ["reward"]
        self.is_closed = False
        self.count = torch.zeros(shape, dtype=torch.int32)
        if not with_step_and_maybe_reset:
            self.step_and_maybe_reset = None
            del self.step_and_maybe_reset

    def _root(self) -> TensorDict:
        false = torch.zeros((*self.batch_size, 1), dtype=torch.bool)
        return TensorDict({"observation": self.count.clone(), "done": false, "terminated": false.clone()},
                          batch_size=self.batch_size)

    def reset(self, tensordict=None, **kwargs):
        if tensordict is not None and "_reset" in tensordict.keys():
            mask = tensordict.get("_reset")
            self.count = torch.where(mask, torch.zeros_like(self.count), self.count)
        else:
            self.count = torch.zeros_like(self.count)
        return self._root()

    def step(self, tensordict):
        self.count = self.count + tensordict.get("action").to(torch.int32)
        done = self.count > self.max_steps
        tensordict.set("next", TensorDict({
            "observation": self.count.clone(), "reward": torch.zeros(self.count.shape),
            "done": done, "terminated": done.clone()}, batch_size=self.batch_size))
        return tensordict

    def step_and_maybe_reset(self, tensordict):
        tensordict = self.step(tensordict)
        next_root = tensordict.get("next").exclude("reward")
        done = next_root.get("done")
        if done.any():
            reset_td = next_root.clone()
            reset_td.set("_reset", done.clone())
            next_root = self.reset(reset_td)
        return tensordict, next_root

    def rand_action(self, tensordict):
        tensordict.set("action", self.full_action_spec["action"].rand())
        return tensordict

    def set_seed(self, seed, static_seed=False):
        torch.manual_seed(seed)
        return seed + 1

    def close(self, raise_if_closed=True):
        self.is_closed = True


class StepCountEnv(CountingEnv):
    """A CountingEnv that already exposes a ``step_count`` observation (like a StepCounter transform)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.observation_spec["step_count"] = Unbounded((*self.batch_size, 1), dtype=torch.int64)

    def _reset_arrays(self, mask=None):
        out = super()._reset_arrays(mask)
        return {**out, "step_count": torch.zeros((*self.batch_size, 1), dtype=torch.int64)}

    def _step_arrays(self, actions):
        obs, reward, term, trunc = super()._step_arrays(actions)
        return {**obs, "step_count": torch.zeros((*self.batch_size, 1), dtype=torch.int64)}, reward, term, trunc


class ConstantObsEnv(CountingEnv):
    """Always observes ``value`` (for ordering tests); ends every ``episode`` steps; optional delay."""

    def __init__(self, value: int = 0, episode: int = 6, delay: float = 0.0, batch_size=()) -> None:
        super().__init__(max_steps=10**9, batch_size=batch_size)
        self.value, self.episode, self.delay = value, episode, delay
        self.t = 0

    def _reset_arrays(self, mask=None):
        self.t = 0
        return {"observation": torch.full((*self.batch_size, 1), self.value, dtype=torch.int32)}

    def _step_arrays(self, actions):
        if self.delay:
            time.sleep(self.delay)
        self.t += 1
        done = torch.full((*self.batch_size, 1), self.t % self.episode == 0)
        obs = torch.full((*self.batch_size, 1), self.value, dtype=torch.int32)
        return {"observation": obs}, self._zero_reward, done, None


class FaultyEnv(CountingEnv):
    """Raises (or hangs) after ``after_steps`` steps, only when built with a ``worker_idx`` in ``bad``.

    ``mode``: ``"raise"`` raises ValueError in step; ``"hang"`` sleeps forever; ``"exit"`` kills the
    process with os._exit.
    """

    def __init__(self, bad=(), worker_idx: int | None = None, after_steps: int = 3, mode: str = "raise") -> None:
        super().__init__(max_steps=4)
        self.is_bad = worker_idx in tuple(bad)
        self.after_steps, self.mode, self.steps = after_steps, mode, 0

    def _step_arrays(self, actions):
        self.steps += 1
        if self.is_bad and self.steps > self.after_steps:
            if self.mode == "raise":
                raise ValueError("FaultyEnv: injected failure")
            if self.mode == "hang":
                while True:
                    time.sleep(1)
            if self.mode == "exit":
                os._exit(3)
        return super()._step_arrays(actions)


class PrivateKeysPolicy(torch.nn.Module):
    """Writes the action and three private keys (test_excluded_keys)."""

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        shape = (*tensordict.batch_size, 1)
        tensordict.set("action", torch.ones(shape, dtype=torch.int8))
        tensordict.set("_dummy", torch.zeros(shape))
        tensordict.set(("out", "_dummy"), torch.zeros(shape))
        tensordict.set(("_out", "dummy"), torch.zeros(shape))
        return tensordict


class SlowCountingEnv(CountingEnv):
    """CountingEnv sleeping ``delay`` seconds per step: a worker slower than the others."""

    def __init__(self, max_steps: int = 2, delay: float = 0.02, batch_size=()) -> None:
        super().__init__(max_steps=max_steps, batch_size=batch_size)
        self.delay = delay

    def _step_arrays(self, actions):
        time.sleep(self.delay)
        return super()._step_arrays(actions)


class ClockEnv(CountingEnv):
    """Observes the wall clock (``time.monotonic()``, system-wide on Linux) at every step."""

    def __init__(self, delay: float = 0.0, batch_size=()) -> None:
        super().__init__(max_steps=10**9, batch_size=batch_size)
        self.observation_spec["clock"] = Unbounded((*self.batch_size, 1), dtype=torch.float64)
        self.delay = delay

    def _clock(self):
        return torch.full((*self.batch_size, 1), time.monotonic(), dtype=torch.float64)

    def _reset_arrays(self, mask=None):
        return {**super()._reset_arrays(mask), "clock": self._clock()}

    def _step_arrays(self, actions):
        if self.delay:
            time.sleep(self.delay)
        obs, reward, term, trunc = super()._step_arrays(actions)
        return {**obs, "clock": self._clock()}, reward, term, trunc


class WeightPolicy(torch.nn.Module):
    """Key-to-key: action = weight (a parameter), whatever the observation."""

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([float(weight)]))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.zeros(observation.shape, dtype=torch.float32) + self.weight


def weight_policy(weight: float = 1.0) -> TensorDictModule:
    return TensorDictModule(WeightPolicy(weight), in_keys=["observation"], out_keys=["action"])


class EchoWeightPolicy(WeightPolicy):
    """action = 1 (CountingEnv observations step by exactly 1), and ``"policy_weight"`` = the weight:
    which weights collected each frame, without changing the trajectories."""

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ones = torch.ones(observation.shape, dtype=torch.float32)
        return ones, ones * self.weight


def echo_weight_policy(weight: float = 1.0) -> TensorDictModule:
    return TensorDictModule(EchoWeightPolicy(weight), in_keys=["observation"], out_keys=["action", "policy_weight"])


class Unpicklable(torch.nn.Module):
    """A policy that refuses to be pickled (test_nonserializable_policy_with_factory_and_weight_sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = weight_policy(1.0)

    def forward(self, tensordict):
        return self.inner(tensordict)

    def __getstate__(self):
        raise RuntimeError("this policy must never be pickled")


def counting_env(max_steps: int = 3):
    return CountingEnv(max_steps=max_steps)


def faulty_env_factory(bad, mode="raise", after_steps=3):
    """Per-worker env constructors: worker i's env knows its index."""
    return [lambda i=i: FaultyEnv(bad=bad, worker_idx=i, after_steps=after_steps, mode=mode) for i in range(2)]


class SchedulingProbeEnv(ContinuousMockEnv):
    """Reports the CPU scheduling policy of the thread that serves it (through ``cascade_execute``)."""

    def scheduling_policy(self) -> int:
        return os.sched_getscheduler(0)


class ItemBuffer:
    """A replay buffer that, like TorchRL's, stores one item per entry of the first batch dim."""

    def __init__(self) -> None:
        import threading

        self.items: list = []
        self.write_count = 0
        self._lock = threading.Lock()

    def extend(self, data) -> None:
        with self._lock:
            rows = list(data.unbind(0))
            self.items.extend(row.clone() for row in rows)
            self.write_count += len(rows)

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class About:
    """What :class:`StructuredEnv` says of itself (``env.about``): a class of the user's that a node can
    send once the main process allows it (``rlharvest.transport.wire.allow_from_nodes``)."""

    name: str
    agents: torch.Tensor


class StructuredEnv:
    """A TensorDict-protocol env with entries the rollout must keep whole (a TorchRL multi-agent,
    heterogeneous, text or dynamic-shape env looks like this):

    * ``("agents", ...)``: a sub-TensorDict with an agent dim of its own (``(*B, agents)``), holding
      each agent's counter, reward and done flags;
    * ``"note"``: non-tensor data (a string naming the step);
    * ``"parts"`` (``heterogeneous=True``): a lazy stack of one TensorDict per agent, agent ``i``'s
      ``"x"`` of shape ``(i + 1,)``;
    * with ``dynamic=True`` the observation ``"grow"`` gets one row longer every step
      (``_has_dynamic_specs``).

    Episodes end after ``max_steps`` steps.
    """

    def __init__(self, max_steps: int = 3, agents: int = 2, heterogeneous: bool = False, dynamic: bool = False,
                 agent_flags: bool = False):
        from rlharvest.envs.specs import Binary as _Binary

        self.batch_size = torch.Size([])
        self.device = torch.device("cpu")
        self.max_steps, self.agents = max_steps, agents
        self.heterogeneous, self.dynamic = heterogeneous, dynamic
        self._has_dynamic_specs = dynamic
        self.full_action_spec = Composite(action=_Binary(shape=(1,), dtype=torch.int8), shape=())
        self.observation_spec = Composite(shape=())
        self.action_keys = ["action"]
        self.agent_flags = agent_flags  # per-agent done/terminated/truncated inside "agents"
        self.done_keys = ["done", "terminated"] + (
            [("agents", "done"), ("agents", "terminated"), ("agents", "truncated")] if agent_flags else [])
        self.reward_keys = ["reward"]
        self.t = 0
        self.is_closed = False
        self.about = About("structured", torch.arange(agents))

    def _state(self, reset: bool) -> TensorDict:
        from tensordict import LazyStackedTensorDict, NonTensorData

        agents = TensorDict({"count": torch.full((self.agents, 1), self.t, dtype=torch.int64)},
                            batch_size=(self.agents,))
        if self.agent_flags:
            flags = torch.full((self.agents, 1), not reset and self.t >= self.max_steps)
            agents.update({"done": flags, "terminated": flags.clone(), "truncated": torch.zeros_like(flags)})
        false = torch.zeros(1, dtype=torch.bool)
        state = TensorDict({"agents": agents, "done": false, "terminated": false.clone(),
                            "note": NonTensorData("reset" if reset else f"step {self.t}")}, batch_size=())
        if self.heterogeneous:
            state["parts"] = LazyStackedTensorDict.lazy_stack(
                [TensorDict({"x": torch.full((i + 1,), float(self.t))}, batch_size=()) for i in range(self.agents)])
        if self.dynamic:
            state["grow"] = torch.full((self.t + 1, 2), float(self.t))
        return state

    def reset(self, tensordict=None, **kwargs):
        self.t = 0
        return self._state(reset=True)

    def step(self, tensordict):
        self.t += 1
        nxt = self._state(reset=False)
        done = torch.tensor([self.t >= self.max_steps])
        nxt["done"], nxt["terminated"] = done, done.clone()
        nxt["reward"] = torch.ones(1)
        tensordict.set("next", nxt)
        return tensordict

    def rand_action(self, tensordict):
        tensordict.set("action", torch.ones(1, dtype=torch.int8))
        return tensordict

    def set_seed(self, seed, static_seed=False):
        return seed + 1

    def close(self, raise_if_closed=True):
        self.is_closed = True


class TaskEnv(ConstantObsEnv):
    """Observes its ``value`` at every step, whatever the episode (an attribute ``setattr_env`` changes:
    every frame shows which value its env had); ``task(scale)`` returns ``value * scale``, ``fail()`` raises."""

    def task(self, scale: int = 1) -> int:
        return self.value * scale

    def fail(self) -> None:
        raise KeyError(f"no task {self.value}")


class Offset(torch.nn.Module):
    """A module inside an env (like a TorchRL ModuleTransform): adds ``offset`` to observations."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = torch.nn.Parameter(torch.zeros(1))


class OffsetCountingEnv(CountingEnv):
    """A CountingEnv whose observation passes through ``env.transform[0]`` (an :class:`Offset`)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.transform = torch.nn.ModuleList([Offset()])
        self.observation_spec["observation"] = Unbounded((*self.batch_size, 1), dtype=torch.float32)

    def _shift(self, out: dict) -> dict:
        return {"observation": out["observation"].float() + self.transform[0].offset.detach()}

    def _reset_arrays(self, mask=None):
        return self._shift(super()._reset_arrays(mask))

    def _step_arrays(self, actions):
        obs, reward, terminated, truncated = super()._step_arrays(actions)
        return self._shift(obs), reward, terminated, truncated


class EpisodeLengthEnv(CountingEnv):
    """Episodes of known lengths, whatever the action: ``lengths`` an int for one env, or one length
    per row of a batched env. The observation counts the steps taken in the current episode."""

    def __init__(self, lengths=3) -> None:
        batched = not isinstance(lengths, int)
        super().__init__(max_steps=10**9, batch_size=(len(lengths),) if batched else ())
        self.lengths = torch.tensor(list(lengths) if batched else [lengths], dtype=torch.int32).reshape(
            *self.batch_size, 1)

    def _step_arrays(self, actions):
        self.count = self.count + 1
        return {"observation": self.count}, self._zero_reward, self.count >= self.lengths, None


def claim(marker: str) -> bool:
    """Whether this call is the first, across processes, to claim ``marker`` (a file made atomically)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class FailOnceEnv(CountingEnv):
    """A CountingEnv that fails once per test: the first env of worker ``bad`` to reach step ``at_step``
    (counted since it was built) fails, and leaves ``marker`` so that its replacement does not.

    ``mode``: ``"raise"`` (ValueError in step), ``"hang"`` (sleeps until killed), ``"kill"`` (SIGKILLs
    its own process, mid-batch), ``"exit"`` (``os._exit(3)``).
    """

    def __init__(self, marker: str, worker_idx: int, bad: int = 1, at_step: int = 10, mode: str = "kill",
                 max_steps: int = 6) -> None:
        super().__init__(max_steps=max_steps)
        self.marker, self.is_bad, self.at_step, self.mode, self.steps = marker, worker_idx == bad, at_step, mode, 0

    def _step_arrays(self, actions):
        self.steps += 1
        if self.is_bad and self.steps == self.at_step and claim(self.marker):
            if self.mode == "raise":
                raise ValueError("FailOnceEnv: injected failure")
            if self.mode == "hang":
                while True:
                    time.sleep(1)
            if self.mode == "kill":
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "exit":
                os._exit(3)
        return super()._step_arrays(actions)


def fail_once_envs(marker, count: int = 2, **kwargs):
    """One FailOnceEnv constructor per worker (worker i's env knows its index)."""
    return [lambda i=i: FailOnceEnv(str(marker), i, **kwargs) for i in range(count)]


class FailOncePolicy(WeightPolicy):
    """``action = weight``; raises once per test (``marker``) at its ``at_call``-th call in a process."""

    def __init__(self, marker: str, at_call: int = 10) -> None:
        super().__init__(1.0)
        self.marker, self.at_call, self.calls = str(marker), at_call, 0

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call and claim(self.marker):
            raise RuntimeError("FailOncePolicy: injected failure")
        return super().forward(observation)


def check_counting_batches(batches, frames_per_batch: int, total_frames: int, step: int = 1) -> dict:
    """The invariants of collection that survived failures, on CountingEnv batches driven by a
    policy whose action is ``step``: every batch complete, no frame twice, observations stepping by
    exactly ``step`` within a trajectory, each trajectory id collected by one worker only, and
    ``total_frames`` met exactly. Returns ``{traj_id: [observations]}``."""
    ids_key = ("collector", "traj_ids")
    seen: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    frames = 0
    for batch in batches:
        assert batch.numel() == frames_per_batch, f"incomplete batch: {batch.numel()} of {frames_per_batch} frames"
        rows = batch.reshape(-1, batch.shape[-1]) if batch.batch_dims > 1 else batch.unsqueeze(0)
        for row, part in enumerate(rows.unbind(0)):
            ids, obs = part.get(ids_key).tolist(), part["observation"].reshape(-1).tolist()
            assert -1 not in ids, "a batch holds steps that were not collected"
            for traj, value in zip(ids, obs):
                seen.setdefault(traj, []).append(value)
                if batch.batch_dims > 1:
                    assert owner.setdefault(traj, row) == row, f"trajectory {traj} collected by two workers"
        frames += batch.numel()
    assert frames == total_frames
    for traj, values in seen.items():
        assert len(values) == len(set(values)), f"trajectory {traj} has a frame twice: {values}"
        assert all(b - a == step for a, b in zip(values, values[1:])), f"trajectory {traj} skips: {values}"
    return seen


class ActionRewardEnv(CountingEnv):
    """CountingEnv rewarded with its action: an episode's return is how far it counted. With
    ``weight_policy(w)``, an episode lasts ``ceil((max_steps + 1) / w)`` steps and returns
    ``max_steps + 1`` (w > 0), or runs until truncated and returns 0 (w = 0). ``delay``: seconds per step."""

    def __init__(self, max_steps: int = 3, delay: float = 0.0, batch_size=()) -> None:
        super().__init__(max_steps=max_steps, batch_size=batch_size)
        self.delay = delay

    def _step_arrays(self, actions):
        if self.delay:
            time.sleep(self.delay)
        obs, _, terminated, truncated = super()._step_arrays(actions)
        return obs, actions["action"].reshape(self.count.shape).to(torch.float32), terminated, truncated


def weight_policy_of(env, weight: float = 1.0) -> TensorDictModule:
    """A policy factory as the Evaluator calls it, ``policy_factory(env)``: ``weight_policy(weight)``."""
    return weight_policy(weight)


def counting_env_7():
    return CountingEnv(max_steps=7)


def check_trajectories(batches: list, total_frames: int, step: int = 1) -> dict:
    """Every frame collected once, each trajectory counting up by ``step`` (the action of
    ``weight_policy(step)``), ``total_frames`` exact, and no step that was not collected (batches of
    any size). Returns ``{traj_id: [observations]}``."""
    seen: dict[int, list[int]] = {}
    frames = 0
    for batch in batches:
        ids, obs = batch.get(("collector", "traj_ids")).reshape(-1).tolist(), batch["observation"].reshape(-1).tolist()
        if batch.batch_dims > 1:  # rows are workers: read each row in time order
            rows = batch.reshape(-1, batch.shape[-1])
            ids = [i for row in rows.unbind(0) for i in row.get(("collector", "traj_ids")).tolist()]
            obs = [o for row in rows.unbind(0) for o in row["observation"].reshape(-1).tolist()]
        assert -1 not in ids, "a batch holds steps that were not collected"
        for traj, value in zip(ids, obs):
            seen.setdefault(traj, []).append(value)
        frames += batch.numel()
    assert frames == total_frames
    for traj, values in seen.items():
        assert len(values) == len(set(values)), f"trajectory {traj} has a frame twice: {values}"
        assert all(b - a == step for a, b in zip(values, values[1:])), f"trajectory {traj} skips: {values}"
    return seen


class StampedPolicy(torch.nn.Module):
    """Two scalar parameters ``a`` and ``b``, always updated to the same value: writes ``action = a``,
    ``b`` (under ``"b"``) and ``"stamp"``, the ``time.monotonic()`` of the action (float64). A frame
    with ``a != b`` ran on half-swapped weights; its stamp tells whether it acted after an update."""

    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(float(value)), requires_grad=False)
        self.b = torch.nn.Parameter(torch.tensor(float(value)), requires_grad=False)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        shape = (*tensordict.batch_size, 1)
        tensordict.set("action", self.a.expand(shape).clone())
        tensordict.set("b", self.b.expand(shape).clone())
        tensordict.set("stamp", torch.full(shape, time.monotonic(), dtype=torch.float64))
        return tensordict


class CallCounter:
    """A forward hook, or forward pre-hook, that writes how many times it has run into the step's
    TensorDict under ``key``; a forward hook given ``action`` also overwrites the policy's action with it.
    A class rather than a closure, so that a policy carrying it reaches worker processes."""

    def __init__(self, key: str, action: float | None = None) -> None:
        self.key, self.action, self.calls = key, action, 0

    def __call__(self, module, args, output=None):
        self.calls += 1
        td = args[0] if output is None else output
        td.set(self.key, torch.full((*td.batch_size, 1), self.calls, dtype=torch.int64))
        if self.action is not None:
            td.set("action", torch.full_like(td.get("action"), self.action))
