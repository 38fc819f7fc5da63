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

from ..checkpoint import (
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    capture_global_rng,
    check_compatible,
    pack,
    restore_global_rng,
    unpack,
    warn_restart,
)
from ..envs.state import EnvStateUnavailable, capture_env_state, restore_env_state, type_name
from ._restarts import RestartCause

__all__ = ["capture", "restore", "capture_remote", "restore_remote", "section_of"]

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
    from ..data import ReplayBuffer

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
        "frames": int(collector._frames),
        "iter": int(collector._iter),
        "total_frames_left": -1 if config.endless else max(0, int(config.total_frames - collector._frames)),
        "policy_version": int(collector._policy_version),
        "traj_counter": int(rollout.traj_counter.peek()),
        "seed_chain": list(collector._seed_chain) if collector._seed_chain is not None else None,
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
    assembler = collector._assembler
    if assembler is not None:
        section["trajectories"] = pack({"in_flight": assembler._in_flight, "complete": assembler._complete})
    return section


def restore(collector, section: dict, where: str) -> None:
    """Continue ``collector`` from ``section`` (its TorchRL keys were loaded already)."""
    rollout = collector.rollout
    rollout.traj_counter.advance_to(section["traj_counter"])
    collector._seed_chain = tuple(section["seed_chain"]) if section["seed_chain"] is not None else None
    restore_buffer(collector.config.replay_buffer, section.get("replay_buffer"))
    continued = _restore_episodes(collector, section, where)
    if section.get("trajectories") is not None and collector._trajectories is not None:
        held = unpack(section["trajectories"])
        collector._trajectories._complete = held["complete"]
        collector._trajectories._in_flight = held["in_flight"] if continued else {}
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


# ---------------------------------------------------------------------------------- collectors with workers
def remote_layout(collector) -> dict[str, Any]:
    return {"collector": type(collector).__name__, "num_workers": int(collector.num_workers),
            "frames_per_batch": int(collector.requested_frames_per_batch),
            "replay_buffer": buffer_kind(collector.config.replay_buffer)}


def capture_remote(collector, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """rlharvest's part of a collector with workers (the workers' parts are under ``worker<i>``)."""
    config = collector.config
    chain = collector._broadcast.seed_chain if collector._broadcast is not None else None
    section = {
        "format_version": FORMAT_VERSION,
        "layout": remote_layout(collector),
        "frames": int(collector._frames),
        "iter": int(collector._iter),
        "total_frames_left": -1 if config.endless else max(0, int(config.total_frames - collector._frames)),
        "policy_version": int(collector._policy_version),
        "seed_chain": list(chain) if chain is not None else None,
        # what a replacement (or the next one) starts from: the seed, how many failed workers it
        # replaces (its env's seed derives from it), past which trajectory ids it counts
        "worker_specs": [{"seed": spec.seed, "static_seed": spec.static_seed, "restart": spec.restart,
                          "traj_offset": spec.traj_offset} if spec is not None else None
                         for spec in collector._fleet.specs],
        "replay_buffer": capture_buffer(collector.config.replay_buffer),
        # the restart budget spent: max_worker_restarts counts over the run, across loads
        "restart_causes": [dataclasses.asdict(cause) for cause in collector._fleet.restarts.causes],
        "leaves": [dataclasses.asdict(cause) for cause in collector._fleet.restarts.leaves],
    }
    section.update(extra or {})
    return section


def check_remote(collector, state_dict: dict) -> dict | None:
    """rlharvest's part of ``state_dict``, checked against ``collector`` (None for TorchRL's format).

    Raises:
        CheckpointMismatchError: naming what differs.
    """
    section = section_of(state_dict)
    if section is not None:
        check_compatible(section, remote_layout(collector), type(collector).__name__)
    return section


def restore_remote(collector, section: dict) -> None:
    """The parent's part: seeds a replacement or an added worker starts from, the seed chain."""
    restore_buffer(collector.config.replay_buffer, section.get("replay_buffer"))
    restarts = collector._fleet.restarts
    restarts.causes = [RestartCause(**cause) for cause in section.get("restart_causes", ())]
    restarts.leaves = [RestartCause(**cause) for cause in section.get("leaves", ())]
    for worker, spec in enumerate(section["worker_specs"]):
        if spec is not None:
            collector._fleet.remember(worker, **spec)
    if section["seed_chain"] is not None:
        collector._broadcast.seed_chain = tuple(section["seed_chain"])
