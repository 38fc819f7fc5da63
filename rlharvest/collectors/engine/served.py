"""A policy served in this process to env workers (``AsyncBatchedCollector``): the inference server
part of the engine (:class:`PolicyServer`), and the loop that turns the workers' chunks of frames into
flat batches of exactly ``frames_per_batch`` frames, or into complete trajectories (:class:`ChunkLoop`,
the :class:`ServedChunks` way of gathering; docs/collection.md).

Every worker runs THE worker loop around an ordinary ``Collector`` whose policy is an inference client;
the actual policy runs in the server's thread here, serving whichever workers are ready in one call.
"""

from __future__ import annotations

import collections
import copy
import multiprocessing.context
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch
from tensordict import TensorDictBase

from ..._utils import TRAJ_IDS
from ...checkpoint import pack, unpack
from ...errors import WorkerError
from ...transport.inference import InferenceChannels, InferenceServer
from ...weight_update.strategy import copy_weights_, weights_of
from .gather import FirstReady
from .loops import LoopParts
from .weights import WeightPublisher, has_weights

__all__ = ["PolicyServer", "ServedChunks", "ChunkLoop", "ENV_INDEX"]

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
    """The served policy, its inference server and the channels env workers call it through.

    Args:
        policy: the user's policy (the server runs a private copy of it when it has weights).
        ctx: the multiprocessing context of the env workers (the channels' shared memory and locks).
        num_workers: env workers, one channel each.
        max_batch_size: most frames one policy call serves.
        min_batch_size: frames gathered, for up to ``timeout`` seconds, before a call.
        timeout: see ``min_batch_size``.
        device: where the policy runs (None: where it is).
        exploration_type: interaction mode of the policy calls.
        trust_policy: use the policy as it is (no wrapping checks).
        version: version of the initial weights.
    """

    def __init__(self, policy: Any, ctx: multiprocessing.context.BaseContext, *, num_workers: int,
                 max_batch_size: int, min_batch_size: int, timeout: float, device: torch.device | None,
                 exploration_type: Any, trust_policy: bool | None, version: int) -> None:
        self.policy = policy
        self.channels = InferenceChannels(ctx, num_workers)
        self.server = InferenceServer(
            _private_copy(policy, device), self.channels, max_batch_size=max_batch_size,
            min_batch_size=min_batch_size, timeout=timeout, device=device, exploration_type=exploration_type,
            trust_policy=trust_policy, version=version)

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

    def policy_error(self) -> BaseException | None:
        """The policy's own error, when it raised in the server."""
        return self.server.error

    def stats(self) -> dict:
        """Counters of the policy server: ``requests``, ``batches``, ``frames``, ``max_batch_frames``."""
        return dict(self.server.stats)

    # ------------------------------------------------------------------ weights (the publisher's ``LocalPolicy``)
    def update_local_policy(self, value: Any, weights: WeightPublisher) -> None:
        """Copy the weights (the policy's own, when ``value`` is None) into the served policy, and count
        the version the server gives them."""
        if value is None:
            value = self.policy if isinstance(self.policy, torch.nn.Module) else None
        taken = weights.weights_from_value(value) if value is not None else None
        weights.version = self.server.update_policy(_copy_in(taken))

    def copy_into_local_policy(self, weights: TensorDictBase) -> None:
        self.server.update_policy(_copy_in(weights))

    def on_version_bump(self, version: int) -> None:
        """The served policy stamps its own versions."""

    # ------------------------------------------------------------------ checkpoints (docs/checkpoints.md)
    def state(self) -> dict:
        """The served policy's weights and version (the workers' policy is a client)."""
        extra: dict[str, Any] = {"server_version": int(self.server.version)}
        if isinstance(self.server.policy, torch.nn.Module):
            extra["served_policy"] = self.server.policy_state_dict()
        return extra

    def restore(self, section: dict) -> None:
        served = section.get("served_policy")
        if served is not None and isinstance(self.server.policy, torch.nn.Module):
            self.server.update_policy(lambda policy: policy.load_state_dict(served))
        self.server.version = int(section["server_version"])


@dataclass(frozen=True)
class ServedChunks:
    """Flat batches of exactly ``frames_per_batch`` frames of whichever env workers are ready, or
    complete trajectories one at a time (``AsyncBatchedCollector``): the hooks run here."""

    sync: ClassVar[bool] = False
    stands_still: ClassVar[bool] = True
    hooks_in_workers: ClassVar[bool] = False

    yield_completed_trajectories: bool = False
    """Yield one complete trajectory at a time instead of batches of ``frames_per_batch`` frames."""

    def loop(self, parts: LoopParts) -> ChunkLoop:
        return ChunkLoop(parts, self.yield_completed_trajectories)


class ChunkLoop(FirstReady):
    """Env workers collect chunks of steps, each asked again at once; the chunks of whichever are ready
    make the batches, assembled (and post-processed, the hooks run) here.

    Args:
        parts: the loop's collaborators.
        trajectories: yield complete trajectories one at a time instead of batches of frames.
    """

    def __init__(self, parts: LoopParts, trajectories: bool = False) -> None:
        super().__init__(parts)
        self.trajectories = trajectories
        self._carry: collections.deque = collections.deque()
        self._carried = 0
        self._partial: dict[int, list] = {}
        self._complete: collections.deque = collections.deque()

    def _loop(self) -> Iterator[TensorDictBase | None]:
        if self.trajectories:
            yield from self._trajectories()
            return
        tally, sizes, hooks = self.tally, self.parts.sizes, self.parts.hooks
        total = tally.budget.total_frames
        while not tally.reached_total():
            pre = hooks["pre_collect_hook"]
            if pre is not None:
                pre()
            wanted = sizes.frames_per_batch()
            if total >= 0:
                wanted = min(wanted, total - tally.frames)
            batch = self._take_frames(wanted)
            tally.iter += 1
            tally.frames += batch.numel()
            yield from self._deliver(batch)

    def _trajectories(self) -> Iterator[TensorDictBase | None]:
        tally = self.tally
        while not tally.reached_total():
            while not self._complete:
                self._split_trajectories(self._next_chunk())
            trajectory = self._complete.popleft()
            tally.iter += 1
            tally.frames += trajectory.numel()
            yield from self._deliver(trajectory)

    def _deliver(self, batch: TensorDictBase) -> Iterator[TensorDictBase | None]:
        """Post-processed here, where the batch is assembled: ``postproc``, then the post-collect hook."""
        buffer = self.parts.replay_buffer
        batch = self.parts.output.postprocess(batch)
        post = self.parts.hooks["post_collect_hook"]
        if post is not None:
            post(batch)
        if buffer is not None:
            buffer.extend(batch)
            yield None
        else:
            yield batch

    def _take_frames(self, wanted: int) -> TensorDictBase:
        """Exactly ``wanted`` frames, in order of arrival; what is left over opens the next batch."""
        while self._carried < wanted:
            chunk = self._next_chunk()
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

    def _next_chunk(self) -> TensorDictBase:
        """The frames of the first worker ready (as a flat private copy); that worker goes on at once.
        Chunks a loaded checkpoint holds (collected before it, not delivered yet) come first."""
        if self.restored:
            worker, _, batch = self.restored.pop(0)
            return flat_chunk(batch, worker)
        for worker in self.idle():
            self.launch(worker, False)
        try:
            worker, reply = self.next()  # restarts are off: a failure raises
        except WorkerError as err:
            error = self.parts.policy_error()
            if error is not None:  # the policy raised in the server: its own error
                raise error from err
            raise
        batch = self.fetched_early.pop((worker, reply.request_id), None)  # by a checkpoint
        if batch is None:
            batch = self.fleet.requests.handles[worker].fetch_batch(reply)
        chunk = flat_chunk(batch, worker)
        self.launch(worker, False)
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
        trajectories)."""
        return {"carry": pack(list(self._carry)), "partial": pack(self._partial),
                "complete": pack(list(self._complete))}

    def restore(self, section: dict) -> None:
        self._carry = collections.deque(unpack(section["carry"]))
        self._carried = sum(chunk.numel() for chunk in self._carry)
        self._partial = unpack(section["partial"])
        self._complete = collections.deque(unpack(section["complete"]))
