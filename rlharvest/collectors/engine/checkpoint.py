"""What a collector adds to TorchRL's state-dict keys for an exact resume (docs/checkpoints.md).

:class:`LocalCheckpoint` holds the part of a :class:`~rlharvest.collectors.Collector` (the rollout
loop's process: its env, the episodes in flight, the process's generators); :class:`FleetCheckpoint`
the part of a collector with workers (its counters and layout; each worker's own part travels in
``worker<i>`` through the broadcast). The format itself (versions, packing, errors) is
``rlharvest/checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import torch

from ...checkpoint import (
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    capture_global_rng,
    check_compatible,
    pack,
    restore_global_rng,
    unpack,
    warn_restart,
)
from ...envs.capture import capture_env_state, restore_env_state
from ...envs.state import EnvStateUnavailable, type_name
from ...rollout import Rollout
from .broadcast import WorkerBroadcast
from .env_calls import LocalEnvCalls
from .fleet import Fleet
from .loops import BatchLoop
from .output import BatchOutput
from .restarts import RestartCause
from .served import PolicyServer
from .state import Tally
from .traj_ids import TrajectoryIds
from .weights import WeightPublisher

__all__ = ["LocalCheckpoint", "FleetCheckpoint", "CheckpointSource", "section_of", "as_actor_list",
           "from_actor_list"]

#: why the env part of a checkpoint is empty when ``state_dict(env_state=False)`` was asked
SKIPPED = "state_dict(env_state=False) left the env state out of the checkpoint"


def buffer_kind(buffer: Any) -> str | None:
    """What the layout records of a collector's replay buffer: its type (None without one)."""
    return None if buffer is None else type_name(buffer)


def capture_buffer(buffer: Any) -> Any:
    """A snapshot of ``buffer``'s own ``state_dict()`` (None without a buffer or one without it).

    rlharvest's :class:`~rlharvest.data.ReplayBuffer` returns copies as plain tensors, kept as they
    are; any other buffer's (TorchRL's: storage, writer, sampler) is pickled now, so later writes
    cannot change the checkpoint and ``torch.load(weights_only=True)`` still reads it.
    """
    if buffer is None or not callable(getattr(buffer, "state_dict", None)):
        return None
    from ...data import ReplayBuffer

    if isinstance(buffer, ReplayBuffer):
        return {"plain": buffer.state_dict()}
    return {"packed": pack(buffer.state_dict())}


def restore_buffer(buffer: Any, saved: Any) -> None:
    """Put what :func:`capture_buffer` captured back into ``buffer``."""
    if buffer is None or saved is None:
        return
    buffer.load_state_dict(saved["plain"] if "plain" in saved else unpack(saved["packed"]))


def section_of(state_dict: dict) -> dict | None:
    """rlharvest's part of a state dict, or None for a TorchRL-only checkpoint."""
    return state_dict.get(CHECKPOINT_KEY)


def _head(layout: dict[str, Any], tally: Tally, version: int) -> dict[str, Any]:
    """What every collector's section starts with: the format, the layout, the counters, the version."""
    return {"format_version": FORMAT_VERSION, "layout": layout, "frames": int(tally.frames), "iter": int(tally.iter),
            "total_frames_left": tally.frames_left(), "policy_version": int(version)}


# ---------------------------------------------------------------------------------- Collector
def _snapshot(weights: dict) -> dict:
    """A copy of a state dict: later updates do not change the checkpoint, and a weight that is a view
    of a larger buffer (weights received into one flat buffer) is saved alone, not with the buffer."""
    copied = type(weights)((name, value.detach().clone()) for name, value in weights.items())
    if hasattr(weights, "_metadata"):
        copied._metadata = weights._metadata
    return copied


class LocalCheckpoint:
    """The checkpoint of a ``Collector`` (the rollout loop in this process): TorchRL's keys, and under
    ``"rlharvest_resume"`` its own part.

    Args:
        env: the env it steps.
        rollout: THE rollout loop (episodes in flight, trajectory ids, the policy's lock).
        policy: the policy it runs now (a face may set another).
        tally: frames and batches so far.
        weights: the policy versions.
        output: the complete trajectories held back.
        replay_buffer: the collector's replay buffer, or None.
        worker_idx: its index in a parent (whose checkpoint holds the shared buffer), or None.
        frames_per_batch: the frames of its batches now (a parent may resize them).
        where: how warnings name this collector (``"Collector"``, ``"worker 2"``).
        env_calls: what ``setattr_env`` set (a checkpoint carries it, and sets it again on load).
    """

    def __init__(self, env: Any, rollout: Rollout, policy: Callable[[], Any], tally: Tally, weights: WeightPublisher,
                 output: BatchOutput, replay_buffer: Any, worker_idx: int | None, frames_per_batch: Callable[[], int],
                 where: str, env_calls: LocalEnvCalls) -> None:
        self.env_calls = env_calls
        self.env = env
        self.rollout = rollout
        self.policy = policy
        self.tally = tally
        self.weights = weights
        self.output = output
        self.replay_buffer = replay_buffer
        self.worker_idx = worker_idx
        self.frames_per_batch = frames_per_batch
        self.where = where
        #: ``(seed, static_seed, next seed)`` of the last ``set_seed``: a checkpoint keeps the seed chain
        self.seed_chain: tuple | None = None

    def layout(self) -> dict[str, Any]:
        """What a checkpoint must have been taken with to be continued exactly."""
        return {"collector": "Collector", "env_batch_size": list(self.env.batch_size),
                "frames_per_batch": int(self.frames_per_batch()),
                "replay_buffer": buffer_kind(self.replay_buffer)}

    def state(self, env_state: bool) -> dict:
        """A ``Collector``'s checkpoint of this moment."""
        state: dict[str, Any] = {}
        policy = self.policy()
        if isinstance(policy, torch.nn.Module):
            state["policy_state_dict"] = _snapshot(policy.state_dict())
        state["env_state_dict"] = self.env.state_dict() if hasattr(self.env, "state_dict") else {}
        state["frames"] = self.tally.frames
        state["iter"] = self.tally.iter
        state["traj_pool"] = {"traj_id": torch.tensor(self.rollout.traj_counter.peek())}
        if self.weights.version_tracker:
            state["policy_version"] = self.weights.version
        state[CHECKPOINT_KEY] = self.capture(env_state)
        return state

    def capture(self, env_state: bool = True) -> dict[str, Any]:
        """rlharvest's part of the checkpoint: a snapshot of this moment."""
        rollout = self.rollout
        section: dict[str, Any] = {
            **_head(self.layout(), self.tally, self.weights.version),
            "traj_counter": int(rollout.traj_counter.peek()),
            "seed_chain": list(self.seed_chain) if self.seed_chain is not None else None,
            "env_settings": list(self.env_calls.settings),
            "rng": capture_global_rng(),
            "env_name": repr(self.env),
            # a worker's buffer is its parent's (shared): the parent's checkpoint holds it once
            "replay_buffer": capture_buffer(self.replay_buffer) if self.worker_idx is None else None,
        }
        if not env_state:
            section["env_skipped"] = SKIPPED
        else:
            try:
                section["env"] = pack(capture_env_state(self.env))
                section["episode"] = pack(rollout.episode_state())
            except EnvStateUnavailable as err:
                section["env_unavailable"] = str(err)
        section.update(self.output.state())
        assembler = self.output.assembler
        if assembler is not None:
            section["trajectories"] = pack({"in_flight": assembler._in_flight, "complete": assembler._complete})
        return section

    def load(self, state_dict: dict, strict: bool) -> None:
        """Continue from :meth:`state`'s checkpoint (a TorchRL one restarts the episodes)."""
        section = section_of(state_dict)
        if section is not None:  # checked before anything changes
            check_compatible(section, self.layout(), self.where)
        policy = self.policy()
        if "policy_state_dict" in state_dict and isinstance(policy, torch.nn.Module):
            policy.load_state_dict(state_dict["policy_state_dict"], strict=strict)
        if state_dict.get("env_state_dict") and hasattr(self.env, "load_state_dict"):
            self.env.load_state_dict(state_dict["env_state_dict"], strict=strict)
        self.tally.frames = state_dict["frames"]
        self.tally.iter = state_dict["iter"]
        if "policy_version" in state_dict or section is not None:
            version = state_dict["policy_version"] if section is None else section["policy_version"]
            self.weights.set_version(int(version))
        if section is not None:
            self.restore(section)
        elif "traj_pool" in state_dict:
            # ids continue after the saved ones (a replay buffer may hold them); episodes restart
            self.rollout.traj_counter.advance_to(int(state_dict["traj_pool"]["traj_id"]))
            self.rollout.reset()

    def restore(self, section: dict) -> None:
        """Continue from ``section`` (its TorchRL keys were loaded already)."""
        rollout = self.rollout
        rollout.traj_counter.advance_to(section["traj_counter"])
        self.seed_chain = tuple(section["seed_chain"]) if section["seed_chain"] is not None else None
        restore_buffer(self.replay_buffer, section.get("replay_buffer"))
        continued = self._restore_episodes(section)
        self.env_calls.restore(section.get("env_settings", ()))
        self.output.restore(section)
        trajectories = self.output.trajectories
        if section.get("trajectories") is not None and trajectories is not None:
            held = unpack(section["trajectories"])
            trajectories._complete = held["complete"]
            trajectories._in_flight = held["in_flight"] if continued else {}
        restore_global_rng(section["rng"])  # last: nothing after it draws from them

    def _restore_episodes(self, section: dict) -> bool:
        """The env's state and the episodes in flight; False when they restart instead."""
        reason = section.get("env_unavailable")
        if "env" in section:
            try:
                restore_env_state(self.env, unpack(section["env"]))
                self.rollout.load_episode_state(unpack(section["episode"]))
                return True
            except EnvStateUnavailable as err:
                reason = str(err)
        if reason is not None:  # an explicit env_state=False restarts the episodes without a warning
            warn_restart(self.where, section.get("env_name", repr(self.env)), reason)
        self.rollout.reset()
        return False


# ---------------------------------------------------------------------------------- collectors with workers
class CheckpointSource(Protocol):
    """A part whose state a collector's checkpoint keeps under ``"rlharvest_resume"``."""

    def state(self) -> dict:
        """Its keys of the section."""

    def restore(self, section: dict) -> None:
        """Continue from the section."""


class FleetCheckpoint:
    """The checkpoint of a collector with workers, at one consistent moment: TorchRL's keys
    (``worker<i>``: each worker's own checkpoint), and under ``"rlharvest_resume"`` the counters, the
    layout, the seeds, the batches collected but not yielded yet, and its sources' state.

    Args:
        name: the collector's class name (the layout's).
        tally: frames and batches so far.
        fleet: the workers (their specs, the restart budget spent).
        broadcast: asks each worker for its own checkpoint (and the seed chain).
        loop: the collector's batches (those in flight, those restored).
        weights: the policy version.
        replay_buffer: the collector's replay buffer, or None.
        frames_per_batch: the frames of the next batch.
        ids: the workers' trajectory ids (the counter they share, or the map of each one's).
        sources: the other parts whose state the section keeps (the weight pushes' counters, ...).
        server: a policy served here (its weights and version), or None.
    """

    def __init__(self, name: str, tally: Tally, fleet: Fleet, broadcast: WorkerBroadcast, loop: BatchLoop,
                 weights: WeightPublisher, replay_buffer: Any, frames_per_batch: Callable[[], int],
                 ids: TrajectoryIds, sources: Sequence[CheckpointSource] = (),
                 server: PolicyServer | None = None) -> None:
        self.name = name
        self.ids = ids
        self.tally = tally
        self.fleet = fleet
        self.broadcast = broadcast
        self.loop = loop
        self.weights = weights
        self.replay_buffer = replay_buffer
        self.frames_per_batch = frames_per_batch
        self.sources = list(sources)
        self.server = server

    def layout(self) -> dict[str, Any]:
        return {"collector": self.name, "num_workers": len(self.fleet),
                "frames_per_batch": int(self.frames_per_batch()),
                "replay_buffer": buffer_kind(self.replay_buffer)}

    def state(self, env_state: bool) -> dict:
        """The checkpoint of this moment (the loop's in-flight rollouts answered first)."""
        self.loop.drain()
        pending = self._pending_batches()
        state = self.broadcast.state_dicts(env_state)
        state.update(frames=self.tally.frames, iter=self.tally.iter)
        counter = self.ids.counter
        if counter is not None:
            state["traj_pool"] = {"traj_id": torch.tensor(counter.peek())}  # TorchRL's key for this counter
        if self.weights.version_tracker:
            state["policy_version"] = self.weights.version
        extra: dict[str, Any] = {"pending": pending, **self.ids.state()}
        for source in self.sources:
            extra.update(source.state())
        extra.update(self.loop.state())
        if self.server is not None:
            extra.update(self.server.state())
        state[CHECKPOINT_KEY] = self._capture(extra)
        return state

    def _pending_batches(self) -> list:
        """Async: the batches collected (drained) but not yielded yet, as ``[worker, frames, packed
        batch]``: the workers' envs are past them, so the checkpoint keeps them to be yielded first."""
        loop = self.loop
        pending = [[worker, frames, pack(batch)] for worker, frames, batch in loop.restored]
        requests = self.fleet.requests
        for worker, request_id in sorted(loop.in_flight().items()):
            reply = requests.peek(worker, request_id)
            if reply is None or reply.written:
                continue
            batch = loop.fetched_early.get((worker, request_id))
            if batch is None:  # fetched once (some transports receive it only once), kept for the iterator
                batch = loop.fetched_early[(worker, request_id)] = requests.handles[worker].fetch_batch(reply)
            pending.append([worker, reply.frames, pack(self.ids.remap(batch.clone(), worker))])
        return pending

    def _capture(self, extra: dict[str, Any]) -> dict[str, Any]:
        fleet = self.fleet
        chain = self.broadcast.seed_chain
        section = {
            **_head(self.layout(), self.tally, self.weights.version),
            "seed_chain": list(chain) if chain is not None else None,
            # what a replacement (or the next one) starts from: the seed, how many failed workers it
            # replaces (its env's seed derives from it), past which trajectory ids it counts
            "worker_specs": [{"seed": spec.seed, "static_seed": spec.static_seed, "restart": spec.restart,
                              "traj_offset": spec.traj_offset} if spec is not None else None
                             for spec in fleet.specs],
            "replay_buffer": capture_buffer(self.replay_buffer),
            # the restart budget spent: max_worker_restarts counts over the run, across loads
            "restart_causes": [dataclasses.asdict(cause) for cause in fleet.restarts.causes],
            "leaves": [dataclasses.asdict(cause) for cause in fleet.restarts.leaves],
        }
        section.update(extra)
        return section

    def load(self, state_dict: dict) -> None:
        """Continue from :meth:`state`'s checkpoint, taken by a collector built with the same arguments;
        a TorchRL checkpoint restarts the episodes.

        Raises:
            CheckpointMismatchError: for a checkpoint of a newer format or of other arguments.
        """
        section = section_of(state_dict)
        if section is not None:
            check_compatible(section, self.layout(), self.name)
        self.broadcast.load_state_dicts(state_dict)
        self.tally.frames = state_dict["frames"]
        self.tally.iter = state_dict["iter"]
        if "policy_version" in state_dict or section is not None:
            self.weights.acknowledge(state_dict["policy_version"] if section is None else section["policy_version"])
        counter = self.ids.counter
        if counter is not None and "traj_pool" in state_dict:
            counter.advance_to(int(state_dict["traj_pool"]["traj_id"]))
        if section is None:
            if counter is not None and "traj_pool" in state_dict:
                self.broadcast.reset()  # episodes restart, with ids after the saved ones
            return
        self._restore(section)

    def _restore(self, section: dict) -> None:
        restore_buffer(self.replay_buffer, section.get("replay_buffer"))
        fleet = self.fleet
        fleet.restarts.causes = [RestartCause(**cause) for cause in section.get("restart_causes", ())]
        fleet.restarts.leaves = [RestartCause(**cause) for cause in section.get("leaves", ())]
        for worker, spec in enumerate(section["worker_specs"]):
            if spec is not None:
                fleet.remember(worker, **spec)
        if section["seed_chain"] is not None:
            self.broadcast.seed_chain = tuple(section["seed_chain"])
        self.loop.restored = [(worker, frames, unpack(batch)) for worker, frames, batch in section["pending"]]
        self.ids.restore(section)
        for source in self.sources:
            source.restore(section)
        self.loop.restore(section)
        if self.server is not None:
            self.server.restore(section)
            self.weights.version = self.server.version


#: the key of the collector's own part of a checkpoint, in the first actor's state dict (RayCollector)
COLLECTOR_KEY = "rlharvest_collector"


def as_actor_list(state: dict, workers: list[int]) -> list[dict]:
    """``state`` as TorchRL's Ray collectors give it: one state dict per actor, in actor order; the
    first also holds, under ``"rlharvest_collector"``, the collector's own part."""
    states = [state.pop(f"worker{worker}") for worker in workers]
    if states:
        states[0] = {**states[0], COLLECTOR_KEY: state}
    return states


def from_actor_list(states: list[dict], workers: list[int]) -> dict | None:
    """The complete checkpoint :func:`as_actor_list` made (None when the list is TorchRL's own)."""
    collector_part = states[0].get(COLLECTOR_KEY) if states else None
    if collector_part is None:
        return None
    plain = [{key: value for key, value in state.items() if key != COLLECTOR_KEY} for state in states]
    return {**collector_part, **{f"worker{worker}": state for worker, state in zip(workers, plain)}}
