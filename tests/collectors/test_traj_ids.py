"""TrajIdMap: collector-wide trajectory ids of workers that count their own, as workers are added."""

from __future__ import annotations

import random

import torch

from rlharvest.collectors.engine.traj_ids import TrajIdMap


def test_a_fixed_fleet_maps_k_to_k_times_w_plus_i():
    ids = TrajIdMap(3)
    assert ids.map_(torch.tensor([0, 1, 2, -1]), worker=2).tolist() == [2, 5, 8, -1]
    assert ids.next_local(2) == 3 and ids.next_local(0) == 0


def test_growth_keeps_every_id_handed_out_and_never_repeats_one():
    rng = random.Random(0)
    ids, handed = TrajIdMap(2), {}  # (worker, local id) -> collector-wide id
    next_local = [0, 0]
    for _ in range(40):
        if rng.random() < 0.15:
            count = rng.randint(1, 3)
            ids.grow(count)
            next_local += [0] * count
        worker = rng.randrange(len(ids))
        # a batch: the trajectory running on (maybe one seen before), then new ones; -1 for cut steps
        first = max(0, next_local[worker] - rng.randint(0, 1))
        locals_ = list(range(first, first + rng.randint(1, 4)))
        next_local[worker] = max(next_local[worker], locals_[-1] + 1)
        batch = torch.tensor(locals_ + [-1])
        mapped = ids.map_(batch.clone(), worker).tolist()
        assert mapped[-1] == -1
        for local, global_id in zip(locals_, mapped):
            assert handed.setdefault((worker, local), global_id) == global_id  # stable across batches
    values = list(handed.values())
    assert len(values) == len(set(values))  # unique across workers, before and after every growth
    assert all(ids.next_local(w) == next_local[w] for w in range(len(ids)) if next_local[w])


def test_a_replacement_continues_past_its_predecessor_after_growth():
    ids = TrajIdMap(1)
    before = ids.map_(torch.tensor([0, 1]), worker=0).tolist()
    ids.grow(1)
    restart_at = ids.next_local(0)  # a replacement's traj_offset
    after = ids.map_(torch.tensor([restart_at, restart_at + 1]), worker=0).tolist()
    new = ids.map_(torch.tensor([0, 1]), worker=1).tolist()
    assert len(set(before + after + new)) == 6
