"""Every rlharvest collector, built the way a TorchRL user builds TorchRL's (launcher="mp" for nodes)."""

from __future__ import annotations

import torch

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector

KINDS = ("collector", "multisync", "multiasync", "distributed", "distributed_async", "distributed_sync", "rpc")
#: kinds whose batches stack one rollout per worker: (workers, *env batch, time)
STACKED = ("multisync", "distributed", "distributed_sync", "rpc")


def make_collector(kind: str, env_fn, policy, *, port: int | None = None, **kwargs):
    """A collector of ``kind`` over two workers/nodes (one env for ``"collector"``)."""
    if kind == "collector":
        return Collector(env_fn, policy, **kwargs)
    if kind == "multisync":
        return MultiSyncCollector([env_fn] * 2, policy, **kwargs)
    if kind == "multiasync":
        return MultiAsyncCollector([env_fn] * 2, policy, **kwargs)
    nodes = {"launcher": "mp", "tcp_port": port}
    if kind == "distributed":
        return DistributedCollector([env_fn] * 2, policy, sync=True, **nodes, **kwargs)
    if kind == "distributed_async":
        return DistributedCollector([env_fn] * 2, policy, sync=False, **nodes, **kwargs)
    if kind == "distributed_sync":
        return DistributedSyncCollector([env_fn] * 2, policy, **nodes, **kwargs)
    if kind == "rpc":
        return RPCCollector([env_fn] * 2, policy, sync=True, **nodes, **kwargs)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def rollouts(batch, kind: str) -> list:
    """The batch as a list of ``(time,)`` rollouts of one env each."""
    flat = batch.reshape(-1, batch.shape[-1]) if batch.batch_dims > 1 else batch.unsqueeze(0)
    return list(flat.unbind(0))


def check_transitions(batch, kind: str) -> None:
    """What every collected batch must satisfy, whatever the env: the auto-reset invariant (the
    next observation of a step that did not end its episode is the observation of the next step)
    and trajectory ids that are valid and change exactly where an episode ended."""
    for rollout in rollouts(batch, kind):
        ids = rollout["collector", "traj_ids"]
        assert (ids >= 0).all()
        done = rollout["next", "done"].reshape(len(ids), -1).any(-1)
        nxt, obs = rollout["next", "observation"], rollout["observation"]
        for t in range(len(ids) - 1):
            if done[t]:
                assert ids[t + 1] != ids[t]
            else:
                assert ids[t + 1] == ids[t]
                torch.testing.assert_close(nxt[t], obs[t + 1])
