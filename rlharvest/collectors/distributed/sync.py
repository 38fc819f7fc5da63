"""DistributedSyncCollector: always synchronous, free-running nodes (docs/collection.md).

Nodes collect continuously and push every batch to the main process without waiting for
instructions; each yielded batch stacks the next batch of every node (``(W, ...)``), so nodes
collect the next one while the caller trains. Weights (when the policy is a module) are pushed
without waiting before batches 0, k, 2k, ... (k = ``update_interval``).
"""

from __future__ import annotations

from typing import Any, Iterator

from tensordict import TensorDictBase

from ...protocol import Command
from ...weight_update.torchdist import DistributedWeightSyncScheme
from .._specs import has_weights
from .._fleet import Fleet
from .._signatures import bind_arguments, derived_signature, method_signature
from ..base import BaseCollector
from ..remote import valid_part
from ..gather import Pushed
from ..options.nodes import TorchDistOptions
from .torchdist import DistributedCollector
from .nodes import NodeCollector

__all__ = ["DistributedSyncCollector"]


class DistributedSyncCollector(NodeCollector):
    """Synchronous collection from free-running nodes over a torch.distributed process group.

    Takes DistributedCollector's arguments except ``sync``, ``update_after_each_batch`` and the
    weight updater/scheme arguments; ``update_interval`` defaults to 1. ``frames_per_batch`` and
    ``total_frames`` (unless -1, endless) must be divisible by the number of nodes.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = DistributedSyncCollector([CountingEnv] * 2, frames_per_batch=10,
        ...                                      total_frames=20, launcher="mp")    # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                                      # doctest: +SKIP
        [(2, 5), (2, 5)]
    """

    #: whether the nodes were told to run free (a class attribute: shutdown after a failed start reads it)
    _pushing = False
    #: iteration itself runs the nodes free; there is no start() into a replay buffer (as TorchRL)
    _supports_run_free = False

    __signature__ = derived_signature(
        DistributedCollector.__init__, defaults={"update_interval": 1},
        drop=("sync", "update_after_each_batch", "weight_updater", "weight_sync_schemes", "weight_recv_schemes",
              "replay_buffer"))

    def __init__(self, *args, **kwargs) -> None:
        self._construct(bind_arguments(type(self).__name__, self.__signature__, args, kwargs))

    def _parse(self, arguments: dict[str, Any]) -> TorchDistOptions:
        return self._parse_sync(**arguments)

    def _parse_sync(self, *, create_env_fn: Any, total_frames: int, update_interval: int | None, policy: Any,
                    policy_factory: Any, backend: str, **others: Any) -> TorchDistOptions:
        count = len(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else 0
        if count and total_frames is not None and total_frames > 0 and total_frames % count:
            raise RuntimeError(f"total_frames={total_frames} must be divisible by the {count} nodes "
                               "(or -1 for endless collection).")
        # sync=False: nodes pick weights up between two env steps, without acknowledging
        schemes = {"policy": DistributedWeightSyncScheme(backend=backend, sync=False)} if (
            has_weights(policy) or policy_factory is not None) else {}
        return TorchDistOptions.parse(
            type(self).__name__, create_env_fn=create_env_fn, total_frames=total_frames, policy=policy,
            policy_factory=policy_factory, backend=backend, sync=True, update_after_each_batch=False,
            update_interval=int(update_interval) if update_interval else 1, weight_updater=None,
            weight_sync_schemes=schemes, weight_recv_schemes=None, replay_buffer=None, **others)

    __init__.__signature__ = method_signature(__signature__)

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        pool = self._requests
        if not self._pushing:
            pool.broadcast(Command.RUN_FREE)
            self._pushing = True
        while not self._reached_total():
            if self._yielded % self.update_interval == 0:
                self._push_weights()
            self._iter += 1
            batches, frames = [], 0
            for node in self.active_workers:
                reply, batch = self._gather.next_of(node, self._fetch_pushed)
                if reply is None:  # it left (preempted) and was not replaced
                    continue
                batches.append(valid_part(batch).clone() if reply.frames < batch.numel() else batch)
                frames += reply.frames
            self._frames += frames
            self._yielded += 1
            yield from self._emit(batches, [], sync=True, counted=True)

    def _workers_run_free(self) -> bool:
        return self._pushing

    def _gather_strategy(self, fleet: Fleet) -> Pushed:
        return Pushed(fleet, self._meter, self._worker_timeout, self.noun)

    def _fetch_pushed(self, node: int, reply) -> TensorDictBase:
        return self._remap_traj_ids(self._fetch(node, reply), node)

    def _after_replacement(self, worker: int) -> None:
        if self._pushing:  # the replacement runs free like the others
            self._requests.request(worker, Command.RUN_FREE)

    def _grown(self, count: int) -> None:
        super()._grown(count)
        for worker in range(self.num_workers - count, self.num_workers):  # the new nodes run free like the others
            self._after_replacement(worker)

    def _push_weights(self) -> None:
        scheme = self._sender_schemes.get("policy")
        if scheme is not None:
            # sync=False: nodes pick it up between two env steps, each counting one version as we do
            BaseCollector.increment_version(self)
            self._updating_weights(scheme.send, counted=False)  # a replacement starts at the new version

    def _close_workers(self, timeout: float) -> None:
        if self._pushing:
            from ._pushed_batches import PushedBatchReceiver

            receiver = PushedBatchReceiver(self)
            receiver.stop_requested.set()
            receiver.run()  # stop the nodes pushing, taking what is in flight, before closing them
            self._pushing = False
        super()._close_workers(timeout)

    # ------------------------------------------------------------------ not available: nodes run free (TorchRL
    # refuses these too)
    def update_policy_weights_(self, *args, **kwargs) -> None:
        raise NotImplementedError("DistributedSyncCollector pushes weights every update_interval batches by itself.")

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        raise NotImplementedError("DistributedSyncCollector does not support set_seed (nodes run free).")

    def state_dict(self, *, env_state: bool = True) -> dict:
        raise NotImplementedError("DistributedSyncCollector has no state_dict: its nodes run free, so there is no "
                                  "moment they all stand still at (docs/checkpoints.md).")

    def load_state_dict(self, state_dict: dict, **kwargs) -> None:
        raise NotImplementedError("DistributedSyncCollector has no load_state_dict: its nodes run free "
                                  "(docs/checkpoints.md).")

    def _write_pushed(self, worker: int, reply) -> None:
        """While stopping: batches pushed after the last yield are dropped (nobody will consume them)."""
        self._requests.handles[worker].fetch_batch(reply)
