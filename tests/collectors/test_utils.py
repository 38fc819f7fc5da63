"""split_trajectories."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlharvest.collectors.utils import split_trajectories

pytestmark = pytest.mark.timeout(30)


def test_split_batched_rows_in_sub_env_then_time_order():
    ids = torch.tensor([[0, 0, 2, 2, 2], [1, 1, 1, 3, 3]])
    td = TensorDict({"obs": torch.arange(10).reshape(2, 5), ("collector", "traj_ids"): ids}, [2, 5])
    out = split_trajectories(td)
    assert out.shape == (4, 3) and out.names[-1] == "time"
    assert out["obs"].tolist() == [[0, 1, 0], [2, 3, 4], [5, 6, 7], [8, 9, 0]]
    assert out["collector", "mask"].sum(-1).tolist() == [2, 3, 3, 2]
    assert out["collector", "traj_ids"][:, 0].tolist() == [0, 2, 1, 3]


def test_split_unpadded_when_rows_are_whole_trajectories():
    td = TensorDict({"obs": torch.arange(4), ("collector", "traj_ids"): torch.zeros(4, dtype=torch.long)}, [4])
    out = split_trajectories(td)
    assert out.shape == (1, 4) and out["collector", "mask"].all()


def test_split_drops_uncollected_steps():
    td = TensorDict({"obs": torch.arange(4), ("collector", "traj_ids"): torch.tensor([5, 5, -1, -1])}, [4])
    out = split_trajectories(td)
    assert out.shape == (1, 2) and out["obs"].tolist() == [[0, 1]]


def test_split_rejects_nested():
    with pytest.raises(NotImplementedError):
        split_trajectories(TensorDict({}, [1]), as_nested=True)
