"""DistributedSyncCollector: always synchronous, free-running nodes (SPEC §4.7).

Nodes collect continuously and push every batch to the main process without waiting for
instructions; each yielded batch stacks the next batch of every node (``(W, ...)``), so nodes
collect the next one while the caller trains. Weights (when the policy is a module) are pushed
without waiting before batches 0, k, 2k, ... (k = ``update_interval``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from tensordict import TensorDictBase

from ...policies import ExplorationType
from ...weight_update.distributed import DistributedWeightSyncScheme
from ...worker import Command
from .. import _multi_setup as setup
from ..single import Collector
from ..remote import valid_part
from .generic import DistributedCollector

__all__ = ["DistributedSyncCollector"]


class DistributedSyncCollector(DistributedCollector):
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

    def __init__(
        self,
        create_env_fn: Sequence[Callable],
        policy: Callable | None = None,
        *,
        policy_factory=None,
        frames_per_batch: int,
        total_frames: int = -1,
        device=None,
        storing_device=None,
        env_device=None,
        policy_device=None,
        max_frames_per_traj: int = -1,
        init_random_frames: int = -1,
        reset_at_each_iter: bool = False,
        postproc=None,
        split_trajs: bool = False,
        exploration_type=ExplorationType.RANDOM,
        collector_class: Any = Collector,
        collector_kwargs=None,
        num_workers_per_collector: int = 1,
        slurm_kwargs: dict | None = None,
        backend: str = "gloo",
        max_weight_update_interval: int = -1,
        update_interval: int = 1,
        launcher: str = "submitit",
        tcp_port: int | None = None,
        worker_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        mp_start_method: str | None = None,
        bind_address: str | None = None,
        authkey: bytes | str | None = None,
        handshake_timeout: float = 5.0,
    ) -> None:
        count = len(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else 0
        setup.check_frames("frames_per_batch", frames_per_batch)
        if count and frames_per_batch % count:
            raise RuntimeError(f"Cannot dispatch {frames_per_batch} frames across {count} nodes: use a "
                               "frames_per_batch divisible by the number of nodes.")
        if count and total_frames is not None and total_frames > 0 and total_frames % count:
            raise RuntimeError(f"total_frames={total_frames} must be divisible by the {count} nodes "
                               "(or -1 for endless collection).")
        schemes = {"policy": DistributedWeightSyncScheme(backend=backend, sync=False)} if (
            setup.has_weights(policy) or policy_factory is not None) else {}
        super().__init__(
            create_env_fn, policy, policy_factory=policy_factory, frames_per_batch=frames_per_batch,
            total_frames=total_frames, device=device, storing_device=storing_device, env_device=env_device,
            policy_device=policy_device, max_frames_per_traj=max_frames_per_traj,
            init_random_frames=init_random_frames, reset_at_each_iter=reset_at_each_iter, postproc=postproc,
            split_trajs=split_trajs, exploration_type=exploration_type, collector_class=collector_class,
            collector_kwargs=collector_kwargs, num_workers_per_collector=num_workers_per_collector, sync=True,
            slurm_kwargs=slurm_kwargs, backend=backend, max_weight_update_interval=max_weight_update_interval,
            update_interval=None, launcher=launcher, tcp_port=tcp_port, weight_sync_schemes=schemes,
            worker_timeout=worker_timeout, heartbeat_timeout=heartbeat_timeout, mp_start_method=mp_start_method,
            bind_address=bind_address, authkey=authkey, handshake_timeout=handshake_timeout,
        )
        self.update_interval = int(update_interval) if update_interval else 1
        self._pushing = False

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        pool = self._pool
        if not self._pushing:
            pool.broadcast(Command.RUN_FREE)
            self._pushing = True
        while not self._reached_total():
            if self._yielded % self.update_interval == 0:
                self._push_weights()
            self._iter += 1
            batches, frames = [], 0
            for node in range(self.num_workers):
                worker, reply = pool.next_pushed(self._worker_timeout, [node]) or (None, None)
                if reply is None:
                    raise TimeoutError(f"node {node} pushed no batch within {self._worker_timeout:g} s.")
                batch = self._remap_traj_ids(pool.handles[node].fetch_batch(reply), node)
                batches.append(valid_part(batch).clone() if reply.frames < batch.numel() else batch)
                frames += reply.frames
            self._frames += frames
            self._yielded += 1
            yield from self._emit(batches, [], sync=True, counted=True)

    def _push_weights(self) -> None:
        scheme = self._sender_schemes.get("policy")
        if scheme is not None:
            scheme.send()  # sync=False: nodes pick it up between two env steps

    def _close_workers(self, timeout: float) -> None:
        if self._pushing:
            from ._push import PushedBatchReceiver

            receiver = PushedBatchReceiver(self)
            receiver.stop_requested.set()
            receiver.run()  # stop the nodes pushing, taking what is in flight, before closing them
            self._pushing = False
        super()._close_workers(timeout)

    # ------------------------------------------------------------------ not available (SPEC §4.7)
    def update_policy_weights_(self, *args, **kwargs) -> None:
        raise NotImplementedError("DistributedSyncCollector pushes weights every update_interval batches by itself.")

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        raise NotImplementedError("DistributedSyncCollector does not support set_seed (nodes run free).")

    def start(self) -> None:
        raise NotImplementedError("Collector start() is not implemented for DistributedSyncCollector.")

    def _write_pushed(self, worker: int, reply) -> None:
        """While stopping: batches pushed after the last yield are dropped (nobody will consume them)."""
        self._pool.handles[worker].fetch_batch(reply)
