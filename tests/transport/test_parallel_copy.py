"""A big weight copy split over threads: every byte lands where one copy_ would put it."""

from __future__ import annotations

import pytest
import torch

from rlharvest.transport import weight_pool
from rlharvest.transport.weight_pool import parallel_copy


@pytest.mark.parametrize("lanes", [2, 3, 4])
def test_a_split_copy_equals_one_copy_per_tensor(monkeypatch, lanes):
    monkeypatch.setattr(weight_pool, "PARALLEL_COPY_BYTES", 0)  # split even these small tensors
    monkeypatch.setattr(weight_pool, "_copy_lanes", lambda: lanes)
    sources = [torch.arange(n, dtype=dtype).reshape(shape) for n, dtype, shape in
               [(7, torch.float32, (7,)), (1000, torch.float64, (10, 100)), (1, torch.int64, (1,)), (333, torch.float32, (333,))]]
    destinations = [torch.zeros_like(s) for s in sources]
    parallel_copy(destinations, sources)
    assert all(torch.equal(d, s) for d, s in zip(destinations, sources))
    chunks = weight_pool._byte_ranges(destinations, sources, lanes)
    assert len(chunks) == lanes  # every lane gets a share
    assert sum(d.numel() * d.element_size() for chunk in chunks for d, _ in chunk) == sum(
        s.numel() * s.element_size() for s in sources)


def test_a_non_contiguous_source_is_copied_whole(monkeypatch):
    monkeypatch.setattr(weight_pool, "PARALLEL_COPY_BYTES", 0)
    monkeypatch.setattr(weight_pool, "_copy_lanes", lambda: 2)
    source = torch.arange(12.0).reshape(3, 4).t()  # a transposed view: no flat byte range
    destination = torch.zeros(4, 3)
    parallel_copy([destination], [source])
    assert torch.equal(destination, source)
