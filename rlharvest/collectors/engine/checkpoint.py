"""What a collector adds to TorchRL's state-dict keys for an exact resume (docs/checkpoints.md).

:func:`capture` and :func:`restore` hold the part of a :class:`~rlharvest.collectors.Collector`
(the rollout loop's process: its env, the episodes in flight, the process's generators);
:func:`capture_remote` and :func:`restore_remote` the part of a collector with workers (its
counters and layout; each worker's own part travels in ``worker<i>`` through the broadcast).
The format itself (versions, packing, errors) is ``rlharvest/checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
from .restarts import RestartCause

__all__ = ["capture", "restore", "local_state", "load_local_state", "engine_state", "load_engine_state", "section_of", "as_actor_list",
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


# ---------------------------------------------------------------------------------- Collector
def layout(collector) -> dict[str, Any]:
    """What a checkpoint of ``collector`` must have been taken with to be continued exactly."""
    return {"collector": "Collector", "env_batch_size": list(collector.env.batch_size),
            "frames_per_batch": int(collector.requested_frames_per_batch),
            "replay_buffer": buffer_kind(collector.config.replay_buffer)}


def capture(collector, env_state: bool = True) -> dict[str, Any]:
    """rlharvest's part of ``collector.state_dict()``: a snapshot of this moment."""
    config, rollout = collector.config, collector.rollout
    section: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "layout": layout(collector),
        "frames": int(collector.frames),
        "iter": int(collector.iter),
        "total_frames_left": -1 if config.endless else max(0, int(config.total_frames - collector.frames)),
        "policy_version": int(collector.weights.version),
        "traj_counter": int(rollout.traj_counter.peek()),
        "seed_chain": list(collector.seed_chain) if collector.seed_chain is not None else None,
        "rng": capture_global_rng(),
        "env_name": repr(collector.env),
        # a worker's buffer is its parent's (shared): the parent's checkpoint holds it once
        "replay_buffer": capture_buffer(collector.config.replay_buffer) if collector.worker_idx is None else None,
    }
    if not env_state:
        section["env_skipped"] = SKIPPED
    else:
        try:
            section["env"] = pack(capture_env_state(collector.env))
            section["episode"] = pack(rollout.episode_state())
        except EnvStateUnavailable as err:
            section["env_unavailable"] = str(err)
    assembler = collector.output.assembler
    if assembler is not None:
        section["trajectories"] = pack({"in_flight": assembler._in_flight, "complete": assembler._complete})
    return section


def restore(collector, section: dict, where: str) -> None:
    """Continue ``collector`` from ``section`` (its TorchRL keys were loaded already)."""
    rollout = collector.rollout
    rollout.traj_counter.advance_to(section["traj_counter"])
    collector.seed_chain = tuple(section["seed_chain"]) if section["seed_chain"] is not None else None
    restore_buffer(collector.config.replay_buffer, section.get("replay_buffer"))
    continued = _restore_episodes(collector, section, where)
    if section.get("trajectories") is not None and collector.output.trajectories is not None:
        held = unpack(section["trajectories"])
        collector.output.trajectories._complete = held["complete"]
        collector.output.trajectories._in_flight = held["in_flight"] if continued else {}
    restore_global_rng(section["rng"])  # last: nothing after it draws from them


def _restore_episodes(collector, section: dict, where: str) -> bool:
    """The env's state and the episodes in flight; False when they restart instead."""
    rollout = collector.rollout
    reason = section.get("env_unavailable")
    if "env" in section:
        try:
            restore_env_state(collector.env, unpack(section["env"]))
            rollout.load_episode_state(unpack(section["episode"]))
            return True
        except EnvStateUnavailable as err:
            reason = str(err)
    if reason is not None:  # an explicit env_state=False restarts the episodes without a warning
        warn_restart(where, section.get("env_name", repr(collector.env)), reason)
    rollout.reset()
    return False


def _snapshot(weights: dict) -> dict:
    """A copy of a state dict: later updates do not change the checkpoint, and a weight that is a view
    of a larger buffer (weights received into one flat buffer) is saved alone, not with the buffer."""
    copied = type(weights)((name, value.detach().clone()) for name, value in weights.items())
    if hasattr(weights, "_metadata"):
        copied._metadata = weights._metadata
    return copied


def local_state(engine, env_state: bool) -> dict:
    """A ``Collector``'s checkpoint: TorchRL's keys, and under ``"rlharvest_resume"`` its own part."""
    state = {}
    if isinstance(engine.policy, torch.nn.Module):
        state["policy_state_dict"] = _snapshot(engine.policy.state_dict())
    state["env_state_dict"] = engine.env.state_dict() if hasattr(engine.env, "state_dict") else {}
    state["frames"] = engine.frames
    state["iter"] = engine.iter
    state["traj_pool"] = {"traj_id": torch.tensor(engine.rollout.traj_counter.peek())}
    if engine.weights.version_tracker:
        state["policy_version"] = engine.weights.version
    state[CHECKPOINT_KEY] = capture(engine, env_state)
    return state


def load_local_state(engine, state_dict: dict, strict: bool) -> None:
    """Continue a ``Collector`` from :func:`local_state`'s checkpoint (a TorchRL one restarts the episodes)."""
    section = section_of(state_dict)
    if section is not None:  # checked before anything changes
        check_compatible(section, layout(engine), engine.where())
    if "policy_state_dict" in state_dict and isinstance(engine.policy, torch.nn.Module):
        engine.policy.load_state_dict(state_dict["policy_state_dict"], strict=strict)
    if state_dict.get("env_state_dict") and hasattr(engine.env, "load_state_dict"):
        engine.env.load_state_dict(state_dict["env_state_dict"], strict=strict)
    engine.frames = state_dict["frames"]
    engine.iter = state_dict["iter"]
    if "policy_version" in state_dict or section is not None:
        version = state_dict["policy_version"] if section is None else section["policy_version"]
        engine.weights.set_version(int(version))
    if section is not None:
        restore(engine, section, engine.where())
    elif "traj_pool" in state_dict:
        # ids continue after the saved ones (a replay buffer may hold them); episodes restart
        engine.rollout.traj_counter.advance_to(int(state_dict["traj_pool"]["traj_id"]))
        engine.rollout.reset()


# ---------------------------------------------------------------------------------- collectors with workers
def remote_layout(engine) -> dict[str, Any]:
    return {"collector": engine.name, "num_workers": int(engine.num_workers),
            "frames_per_batch": int(engine.requested_frames_per_batch),
            "replay_buffer": buffer_kind(engine.config.replay_buffer)}


def engine_state(engine, env_state: bool) -> dict:
    """The checkpoint of a collector with workers, at one consistent moment: TorchRL's keys
    (``worker<i>``: each worker's own checkpoint), and under ``"rlharvest_resume"`` the counters, the
    layout, the seeds and (asynchronous collectors) the batches collected but not yielded yet."""
    loop = engine.loop
    loop.drain()
    pending = _pending_batches(engine)
    state = engine.broadcast.state_dicts(env_state)
    state.update(frames=engine.frames, iter=engine.iter)
    counter = engine.ids.counter
    if counter is not None:
        state["traj_pool"] = {"traj_id": torch.tensor(counter.peek())}  # TorchRL's key for this counter
    if engine.weights.version_tracker:
        state["policy_version"] = engine.weights.version
    extra = {"pending": pending, **engine.ids.state(), **engine.schedule.state()}
    if engine.server is not None:
        extra.update(engine.server.state())
    state[CHECKPOINT_KEY] = _capture_remote(engine, extra)
    return state


def _pending_batches(engine) -> list:
    """Async: the batches collected (drained) but not yielded yet, as ``[worker, frames, packed
    batch]``: the workers' envs are past them, so the checkpoint keeps them to be yielded first."""
    loop = engine.loop
    pending = [[worker, frames, pack(batch)] for worker, frames, batch in loop.restored]
    if engine.traits.sync or loop.gather is None:
        return pending
    requests = engine.requests
    for worker, request_id in sorted(loop.gather.in_flight.items()):
        reply = requests.peek(worker, request_id)
        if reply is None or reply.written:
            continue
        batch = loop.fetched_early.get((worker, request_id))
        if batch is None:  # fetched once (some transports receive it only once), kept for the iterator
            batch = loop.fetched_early[(worker, request_id)] = requests.handles[worker].fetch_batch(reply)
        pending.append([worker, reply.frames, pack(engine.ids.remap(batch.clone(), worker))])
    return pending


def _capture_remote(engine, extra: dict[str, Any]) -> dict[str, Any]:
    config, fleet = engine.config, engine.fleet
    chain = engine.broadcast.seed_chain if engine.broadcast is not None else None
    section = {
        "format_version": FORMAT_VERSION,
        "layout": remote_layout(engine),
        "frames": int(engine.frames),
        "iter": int(engine.iter),
        "total_frames_left": -1 if config.endless else max(0, int(config.total_frames - engine.frames)),
        "policy_version": int(engine.weights.version),
        "seed_chain": list(chain) if chain is not None else None,
        # what a replacement (or the next one) starts from: the seed, how many failed workers it
        # replaces (its env's seed derives from it), past which trajectory ids it counts
        "worker_specs": [{"seed": spec.seed, "static_seed": spec.static_seed, "restart": spec.restart,
                          "traj_offset": spec.traj_offset} if spec is not None else None
                         for spec in fleet.specs],
        "replay_buffer": capture_buffer(config.replay_buffer),
        # the restart budget spent: max_worker_restarts counts over the run, across loads
        "restart_causes": [dataclasses.asdict(cause) for cause in fleet.restarts.causes],
        "leaves": [dataclasses.asdict(cause) for cause in fleet.restarts.leaves],
    }
    section.update(extra)
    return section


def load_engine_state(engine, state_dict: dict) -> None:
    """Continue from :func:`engine_state`'s checkpoint, taken by a collector built with the same
    arguments; a TorchRL checkpoint restarts the episodes.

    Raises:
        CheckpointMismatchError: for a checkpoint of a newer format or of other arguments.
    """
    section = section_of(state_dict)
    if section is not None:
        check_compatible(section, remote_layout(engine), engine.name)
    engine.broadcast.load_state_dicts(state_dict)
    engine.frames = state_dict["frames"]
    engine.iter = state_dict["iter"]
    if "policy_version" in state_dict or section is not None:
        engine.weights.version = int(state_dict["policy_version"] if section is None else section["policy_version"])
    counter = engine.ids.counter
    if counter is not None and "traj_pool" in state_dict:
        counter.advance_to(int(state_dict["traj_pool"]["traj_id"]))
    if section is None:
        if counter is not None and "traj_pool" in state_dict:
            engine.broadcast.reset()  # episodes restart, with ids after the saved ones
        return
    restore_buffer(engine.config.replay_buffer, section.get("replay_buffer"))
    fleet = engine.fleet
    fleet.restarts.causes = [RestartCause(**cause) for cause in section.get("restart_causes", ())]
    fleet.restarts.leaves = [RestartCause(**cause) for cause in section.get("leaves", ())]
    for worker, spec in enumerate(section["worker_specs"]):
        if spec is not None:
            fleet.remember(worker, **spec)
    if section["seed_chain"] is not None:
        engine.broadcast.seed_chain = tuple(section["seed_chain"])
    engine.loop.restored = [(worker, frames, unpack(batch)) for worker, frames, batch in section["pending"]]
    engine.ids.restore(section)
    if "batches_since_update" in section:
        engine.schedule.restore(section)
    if engine.server is not None:
        engine.server.restore(section, engine.weights)


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
