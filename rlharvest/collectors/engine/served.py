"""A policy served in this process to env workers (``AsyncBatchedCollector``): the inference server
part of the engine, and the loop that turns the workers' chunks of frames into flat batches of exactly
``frames_per_batch`` frames, or into complete trajectories (docs/collection.md).

Every worker runs THE worker loop around an ordinary ``Collector`` whose policy is an inference client;
the actual policy runs in the server's thread here, serving whichever workers are ready in one call.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDictBase

from ..._utils import TRAJ_IDS
from ...checkpoint import pack, unpack
from ...errors import WorkerError
from ...transport.inference import InferenceChannels, InferenceServer
from ...weight_update.strategy import copy_weights_, weights_of
from ..options.common import has_weights


__all__ = ["PolicyServer", "ENV_INDEX"]

ENV_INDEX = "env_index"


def _private_copy(policy: Any, device: torch.device | None) -> Any:
    """The policy the server runs: a copy when it has weights (only updates change it), on ``device``."""
    if not isinstance(policy, torch.nn.Module) or not has_weights(policy):
        return policy
    served = copy.deepcopy(policy)
    return served.to(device) if device is not None else served


def _copy_in(weights: TensorDictBase | None) -> Callable[[Any], None] | None:
    """What the server runs on its policy to take ``weights`` (nothing for a policy without weights)."""
    if weights is None:
        return None

    def change(served: Any) -> None:
        if isinstance(served, torch.nn.Module):
            copy_weights_(weights_of(served), weights)

    return change


def flat_chunk(batch: TensorDictBase, worker: int) -> TensorDictBase:
    """A worker's ``(*env_batch, T)`` batch as a flat private copy of its valid frames, with ``env_index``."""
    envs = batch.batch_size[:-1].numel()
    steps = batch.batch_size[-1]
    flat = batch.clone(recurse=True)
    flat.names = [None] * flat.batch_dims
    flat = flat.reshape(-1)
    first = worker * envs
    flat.set(ENV_INDEX, torch.arange(first, first + envs, dtype=torch.int64).repeat_interleave(steps))
    ids = flat.get(TRAJ_IDS)
    if bool((ids == -1).any()):  # an interrupted rollout (shutdown): only the collected steps are frames
        flat = flat[ids != -1]
    return flat


class PolicyServer:
    """The served policy, its inference server and channels, and what is assembled here between batches.

    Args:
        options: the collector's options (``AsyncBatchedOptions``).
        engine: the engine it belongs to.
    """

    def __init__(self, options: Any, engine: Any) -> None:
        batched = options.batched
        self.options = options
        self.policy = options.policy
        self.channels = InferenceChannels(engine.backend.ctx, batched.num_workers)
        self.server = InferenceServer(
            _private_copy(options.policy, batched.device), self.channels, max_batch_size=batched.max_batch_size,
            min_batch_size=batched.min_batch_size, timeout=batched.server_timeout, device=batched.device,
            exploration_type=options.config.exploration_type, trust_policy=options.config.trust_policy,
            version=batched.policy_version)
        engine.weights.version = batched.policy_version
        self._carry: collections.deque = collections.deque()
        self._carried = 0
        self._partial: dict[int, list] = {}
        self._complete: collections.deque = collections.deque()

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Once the workers are started (no thread of the server runs while they are forked)."""
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.channels.close()

    @property
    def version(self) -> int:
        return self.server.version

    def setup_error(self) -> BaseException | None:
        """The policy's or the env's own error, when a worker failed to build because of it."""
        return self.server.setup_error

    def stats(self) -> dict:
        """Counters of the policy server: ``requests``, ``batches``, ``frames``, ``max_batch_frames``."""
        return dict(self.server.stats)

    # ------------------------------------------------------------------ weights
    def update(self, weights: Any, value: Any) -> int:
        """Copy the weights (the policy's own, when ``value`` is None) into the served policy; returns the
        new version."""
        if value is None:
            value = self.policy if isinstance(self.policy, torch.nn.Module) else None
        taken = weights.weights_from_value(value) if value is not None else None
        return self.server.update_policy(_copy_in(taken))

    def copy_in(self, weights: TensorDictBase) -> None:
        self.server.update_policy(_copy_in(weights))

    # ------------------------------------------------------------------ batches
    def batches(self, engine: Any) -> Iterator[TensorDictBase | None]:
        if self.options.batched.yield_completed_trajectories:
            yield from self._trajectories(engine)
            return
        total = engine.config.total_frames
        while not engine.reached_total():
            pre = engine.hooks["pre_collect_hook"]
            if pre is not None:
                pre()
            wanted = engine.config.frames_per_batch
            if total >= 0:
                wanted = min(wanted, total - engine.frames)
            batch = self._take_frames(engine, wanted)
            engine.iter += 1
            engine.frames += batch.numel()
            yield from self._deliver(engine, batch)

    def _trajectories(self, engine: Any) -> Iterator[TensorDictBase | None]:
        while not engine.reached_total():
            while not self._complete:
                self._split_trajectories(self._next_chunk(engine))
            trajectory = self._complete.popleft()
            engine.iter += 1
            engine.frames += trajectory.numel()
            yield from self._deliver(engine, trajectory)

    def _deliver(self, engine: Any, batch: TensorDictBase) -> Iterator[TensorDictBase | None]:
        """Post-processed here, where the batch is assembled: ``postproc``, then the post-collect hook."""
        buffer = engine.config.replay_buffer
        batch = engine.output.postprocess(batch)
        post = engine.hooks["post_collect_hook"]
        if post is not None:
            post(batch)
        if buffer is not None:
            buffer.extend(batch)
            yield None
        else:
            yield batch

    def _take_frames(self, engine: Any, wanted: int) -> TensorDictBase:
        """Exactly ``wanted`` frames, in order of arrival; what is left over opens the next batch."""
        while self._carried < wanted:
            chunk = self._next_chunk(engine)
            self._carry.append(chunk)
            self._carried += chunk.numel()
        chunks = list(self._carry)
        batch = torch.cat(chunks, 0) if len(chunks) > 1 else chunks[0]
        self._carry.clear()
        self._carried = batch.numel() - wanted
        if self._carried:
            self._carry.append(batch[wanted:])
            batch = batch[:wanted]
        return batch

    def _next_chunk(self, engine: Any) -> TensorDictBase:
        """The frames of the first worker ready (as a flat private copy); that worker goes on at once.
        Chunks a loaded checkpoint holds (collected before it, not delivered yet) come first."""
        loop = engine.loop
        if loop.restored:
            worker, _, batch = loop.restored.pop(0)
            return flat_chunk(batch, worker)
        gather = loop.gather
        for worker in gather.idle():
            gather.launch(worker, False)
        try:
            worker, reply = gather.next()  # restarts are off: a failure raises
        except WorkerError as err:
            error = self.server.error
            if error is not None:  # the policy raised in the server: its own error
                raise error from err
            raise
        batch = loop.fetched_early.pop((worker, reply.request_id), None)  # by a checkpoint
        if batch is None:
            batch = engine.requests.handles[worker].fetch_batch(reply)
        chunk = flat_chunk(batch, worker)
        gather.launch(worker, False)
        return chunk

    def _split_trajectories(self, chunk: TensorDictBase) -> None:
        """Queue the trajectories a chunk completes; keep the unfinished ends, per env."""
        done = chunk.get(("next", "done")).reshape(chunk.shape[0], -1).any(-1)
        envs = chunk.get(ENV_INDEX)
        for env in envs.unique().tolist():
            rows = (envs == env).nonzero().squeeze(-1)
            pieces = self._partial.setdefault(env, [])
            start = 0
            for end in done[rows].nonzero().squeeze(-1).tolist():
                pieces.append(chunk[rows[start:end + 1]])
                self._complete.append(torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0])
                pieces.clear()
                start = end + 1
            if start < rows.numel():
                pieces.append(chunk[rows[start:]])

    # ------------------------------------------------------------------ checkpoints (docs/checkpoints.md)
    def state(self) -> dict:
        """The frames assembled here and not delivered yet (the next batch's first frames, the pieces of
        trajectories), and the served policy's weights and version (the workers' policy is a client)."""
        extra = {"carry": pack(list(self._carry)), "partial": pack(self._partial),
                 "complete": pack(list(self._complete)), "server_version": int(self.server.version)}
        if isinstance(self.server.policy, torch.nn.Module):
            extra["served_policy"] = self.server.policy_state_dict()
        return extra

    def restore(self, section: dict, weights: Any) -> None:
        self._carry = collections.deque(unpack(section["carry"]))
        self._carried = sum(chunk.numel() for chunk in self._carry)
        self._partial = unpack(section["partial"])
        self._complete = collections.deque(unpack(section["complete"]))
        served = section.get("served_policy")
        if served is not None and isinstance(self.server.policy, torch.nn.Module):
            self.server.update_policy(lambda policy: policy.load_state_dict(served))
        self.server.version = int(section["server_version"])
        weights.version = self.server.version
