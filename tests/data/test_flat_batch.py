"""A batch packed for pickling (Ray replies) must come back equal and private, whatever it holds."""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict

from rlharvest.data.flat import FlatBatch, FlatUnpacker

pytestmark = pytest.mark.timeout(30)


def batch(fill: int = 0, device=None) -> TensorDict:
    """A rollout-shaped batch: nested keys, mixed dtypes (1-byte bools before 8-byte ints), names."""
    td = TensorDict({
        "observation": torch.arange(16, dtype=torch.int32).view(16, 1) + fill,
        "done": torch.zeros(16, 1, dtype=torch.bool),
        ("next", "reward"): torch.full((16, 1), float(fill)),
        ("next", "done"): torch.ones(16, 1, dtype=torch.bool),
        ("collector", "traj_ids"): torch.arange(16, dtype=torch.int64) + fill,
        "pixels": torch.randint(0, 255, (16, 3, 5, 7), dtype=torch.uint8),
        "value": torch.randn(16, 2, dtype=torch.float64),
    }, [16], device=device)
    td.refine_names("time")
    return td


def roundtrip(td: TensorDict, unpacker: FlatUnpacker | None = None) -> TensorDict:
    packed = pickle.loads(pickle.dumps(FlatBatch.of(td), protocol=5))
    return packed.unpack() if unpacker is None else unpacker.unpack(packed)


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_packed_batch_comes_back_equal(device):
    td = batch(3, device)
    out = roundtrip(td)
    assert set(out.keys(True, True)) == set(td.keys(True, True))
    for key in td.keys(True, True):
        assert out.get(key).dtype == td.get(key).dtype
        assert torch.equal(out.get(key), td.get(key)), key
    assert out.batch_size == td.batch_size and out.names == td.names and out.device == td.device


def test_a_packed_batch_is_a_private_copy():
    td = batch(1)
    packed = FlatBatch.of(td)
    td["observation"].fill_(-7)  # the worker reuses its buffer for the next rollout
    out = packed.unpack()
    assert (out["observation"] != -7).all()
    out["observation"].fill_(-5)  # writable, and not shared with what was unpickled
    assert (packed.unpack()["observation"] != -5).all()


def test_the_unpacker_reuses_its_buffer_but_every_batch_stays_private():
    unpacker = FlatUnpacker()
    first = roundtrip(batch(1), unpacker)
    second = roundtrip(batch(2), unpacker)
    assert (first["observation"].flatten() == torch.arange(16) + 1).all()
    assert (second["observation"].flatten() == torch.arange(16) + 2).all()
    assert first["observation"].data_ptr() != second["observation"].data_ptr()


def test_the_unpacker_follows_a_change_of_layout_or_device():
    unpacker = FlatUnpacker()
    roundtrip(batch(1), unpacker)
    smaller = batch(2)[:4]
    out = roundtrip(smaller, unpacker)
    assert out.batch_size == torch.Size([4]) and torch.equal(out["value"], smaller["value"])
    assert roundtrip(batch(3, "cpu"), unpacker).device == torch.device("cpu")
    assert roundtrip(batch(3), unpacker).device is None


def test_padding_between_leaves_is_zeroed():
    packed = FlatBatch.of(batch(1))
    used = torch.zeros(packed.layout.total_bytes, dtype=torch.bool)
    for _, _, _, offset, nbytes in packed.layout.entries:
        used[offset:offset + nbytes] = True
    assert (torch.from_numpy(packed.data.copy())[~used] == 0).all()


def test_what_cannot_be_packed_is_said():
    assert FlatBatch.packable(batch())
    with_grad = batch()
    with_grad["value"] = torch.zeros(16, 2, requires_grad=True)
    assert not FlatBatch.packable(with_grad)
    non_tensor = batch()
    non_tensor.set_non_tensor("note", "text")
    assert not FlatBatch.packable(non_tensor)
