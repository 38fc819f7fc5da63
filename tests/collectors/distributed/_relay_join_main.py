"""Main process of test_relay_join.py, run in host A: ``python _relay_join_main.py --port P --host-ip A --ifname IF``.

A ``launcher="external"`` DistributedCollector with 3 slots and the relay between hosts on (the default of
``DistributedWeightSyncScheme``). It prints its join command (``join``), waits for a node in every slot,
then prints one JSON event per line (flushed) as it goes:

* ``update`` (k = 1, 2): each update fills the whole policy weight with ``k`` (policy version ``k``); the
  event has the bytes that left through ``--ifname`` during it and what every node ran in the two batches
  after it (as ``host_copies_main`` in _node_scripts.py);
* ``leave-me``: the test sends SIGTERM to one node (its slot is left empty: ``max_worker_restarts=0``);
* ``join-me`` once the collector saw it leave: the test runs the join command on a new host;
* ``joined``: the first batch with a node in every slot again, what each node ran in it (the joiner's
  rows: the weights and version of update 2, which it got at its join), and the bytes that left
  through ``--ifname`` from ``join-me`` until then;
* ``update`` (k = 3 .. ``--updates``), ``stats``, ``shutdown``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _node_scripts import _emit, _make_env, _tx_bytes, _wide_policy  # noqa: E402

SLOTS = 3


def _ran(batch, rows: int) -> dict:
    """What each node ran in ``batch``: the extremes of its weight and its policy version, per frame."""
    return {"weight_min": batch["weight_min"].reshape(rows, -1).tolist(),
            "weight_max": batch["weight_max"].reshape(rows, -1).tolist(),
            "versions": batch["policy_version"].reshape(rows, -1).tolist()}


def _update(collector, policy, batches, k: int, ifname: str) -> None:
    """Update ``k`` (the whole weight set to ``k``), then two batches: the bytes out and what ran."""
    import torch

    with torch.no_grad():
        policy.module.weight.fill_(float(k))
    before, start = _tx_bytes(ifname), time.perf_counter()
    collector.update_policy_weights_()
    seconds, sent = time.perf_counter() - start, _tx_bytes(ifname) - before
    ran = [_ran(next(batches), SLOTS) for _ in range(2)]
    _emit(event="update", k=k, seconds=seconds, tx_bytes=sent, policy_version=collector.policy_version,
          weight_min=[r["weight_min"] for r in ran], weight_max=[r["weight_max"] for r in ran],
          versions=[r["versions"] for r in ran])


def _batches_until(batches, done, limit: int, what: str, pause: float = 0.05):
    """Collect, ``pause`` s apart (the machine is shared), until ``done(batch)``: that batch and how many
    were collected; fails after ``limit`` batches."""
    for count in range(1, limit + 1):
        batch = next(batches)
        if done(batch):
            return batch, count
        time.sleep(pause)
    raise RuntimeError(f"no batch with {what} within {limit} batches")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host-ip", required=True)
    parser.add_argument("--ifname", required=True)
    parser.add_argument("--params", type=int, default=250_000)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--heartbeat-timeout", type=float, default=9.0)
    args = parser.parse_args(argv)

    import torch

    from rlharvest.collectors.distributed import DistributedCollector
    from rlharvest.weight_update import DistributedWeightSyncScheme

    torch.set_num_threads(1)
    policy = _wide_policy(args.params)
    collector = DistributedCollector(
        [_make_env] * SLOTS, policy, launcher="external", tcp_port=args.port, bind_address=args.host_ip,
        heartbeat_timeout=args.heartbeat_timeout, frames_per_batch=2 * SLOTS, total_frames=-1, worker_timeout=120.0,
        sync=True, track_policy_version=True, max_worker_restarts=0, preemption_grace=2.0,
        weight_sync_schemes={"policy": DistributedWeightSyncScheme()})
    _emit(event="join", argv=collector.join_command(), weight_bytes=4 * args.params)
    try:
        batches = iter(collector)
        next(batches)
        _emit(event="started", active=collector.active_workers)
        for k in (1, 2):
            _update(collector, policy, batches, k, args.ifname)
        _emit(event="leave-me")
        _batches_until(batches, lambda b: collector.stats()["preemptions"] == 1, 400, "the node gone")
        empty = sorted(set(range(SLOTS)) - set(collector.active_workers))
        before = _tx_bytes(args.ifname)
        _emit(event="join-me", empty=empty)
        start = time.monotonic()
        # slowly: the bytes counted while the node joins are its copy plus ~1 KB of commands per batch
        batch, count = _batches_until(batches, lambda b: b.shape[0] == SLOTS, 400, "a node in every slot", pause=0.5)
        _emit(event="joined", tx_bytes=_tx_bytes(args.ifname) - before, batches=count,
              seconds=time.monotonic() - start, empty=empty,
              active=collector.active_workers, policy_version=collector.policy_version, **_ran(batch, SLOTS))
        for k in range(3, args.updates + 1):
            _update(collector, policy, batches, k, args.ifname)
        stats = collector.stats()
        _emit(event="stats", restarts=stats["restarts"], preemptions=stats["preemptions"])
    finally:
        collector.shutdown()
        _emit(event="shutdown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
