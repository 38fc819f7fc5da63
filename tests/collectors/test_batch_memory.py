"""Collector hands each batch out as it was written, and writes a later batch into the memory of one the
caller has let go of (rlharvest/batch_buffer.py, ``BufferPool``): never into one still held, by the batch,
a leaf, a view, a numpy array, a nested TensorDict or another process."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp
from mocks import CountingPolicy
from process_check import assert_no_children

from rlharvest.collectors import Collector
from rlharvest.envs import CountingEnv

pytestmark = pytest.mark.timeout(60)

BATCHES = 12


def collector(**kwargs):
    return Collector(CountingEnv(max_steps=5, batch_size=(4,)), CountingPolicy(), frames_per_batch=4 * 8,
                     total_frames=4 * 8 * BATCHES, **kwargs)


def pointers(batch) -> set[int]:
    return {leaf.data_ptr() for leaf in batch.values(True, True)}


def test_batches_the_caller_drops_are_written_again_and_no_new_memory_is_taken():
    seen: list[frozenset] = []
    with collector() as c:
        for batch in c:
            seen.append(frozenset(pointers(batch)))
            del batch
    # after the first batches, every batch lands in the memory of one handed out before
    assert len(set(seen)) <= 3, f"{len(set(seen))} distinct buffers for {len(seen)} batches"


@pytest.mark.parametrize("hold", ["batch", "leaf", "view", "numpy", "nested"])
def test_a_batch_still_held_in_any_way_is_never_written_again(hold):
    kept, copies = [], []
    with collector() as c:
        for batch in c:
            copies.append(batch.clone())
            if hold == "batch":
                kept.append(batch)
            elif hold == "leaf":
                kept.append(batch["next", "observation"])
            elif hold == "view":
                kept.append(batch["next", "observation"][:, 1:])
            elif hold == "numpy":
                kept.append(batch["next", "observation"].numpy())
            else:
                kept.append(batch["next"])
            del batch
    assert len(kept) == BATCHES
    for held, copy in zip(kept, copies):
        if hold == "batch":
            assert (held == copy).all()
        elif hold == "nested":
            assert (held == copy["next"]).all()
        elif hold == "numpy":
            assert (torch.from_numpy(held) == copy["next", "observation"]).all()
        elif hold == "view":
            assert (held == copy["next", "observation"][:, 1:]).all()
        else:
            assert (held == copy["next", "observation"]).all()


def _keep_then_sum(batches, sums) -> None:
    kept = []
    while (batch := batches.get(timeout=30)) is not None:
        kept.append(batch)  # the batches' memory, shared with the collector's process
    sums.put([float(b["next", "observation"].sum()) for b in kept])


def test_a_batch_sent_to_another_process_is_never_written_again():
    """Sent through a torch.multiprocessing queue, a batch's memory is shared with the receiver: the
    sender keeps no reference to it, and yet it is the receiver's to read."""
    context = tmp.get_context("fork")
    batches, sums = context.Queue(), context.Queue()
    receiver = context.Process(target=_keep_then_sum, args=(batches, sums), daemon=True)
    receiver.start()
    try:
        expected = []
        with collector() as c:
            for batch in c:
                expected.append(float(batch["next", "observation"].sum()))
                batches.put(batch)
                del batch
        batches.put(None)
        assert sums.get(timeout=30) == expected
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    assert_no_children()


def test_a_reused_batch_holds_the_same_values_as_a_new_one():
    """Written into recycled memory or into new memory, the batches are the same: no value survives from
    the batch that memory held before (the root done flags no step writes are zeroed too)."""
    with collector() as c:
        recycled = [b.clone() for b in c]
    kept = []
    with collector() as c:
        for batch in c:
            kept.append(batch)  # every batch held: all in new memory
    for a, b in zip(recycled, kept):
        assert (a == b).all()
    assert not recycled[-1]["done"].any()


def test_a_batch_renamed_or_reshaped_by_the_caller_does_not_shape_the_batches_written_into_its_memory():
    """The caller may name a batch's dims or flatten its batch size in place before dropping it: the batches
    later written into its memory still have the collector's shape and the time dim named "time"."""
    shapes = []
    with collector() as c:
        for i, batch in enumerate(c):
            shapes.append((tuple(batch.batch_size), tuple(batch.names), tuple(batch["next"].names)))
            if i % 2:
                batch.refine_names("env", "time")
            else:
                batch.names = [None, None]
                batch.batch_size = (4,)
            del batch
    assert set(shapes) == {((4, 8), (None, "time"), (None, "time"))}, shapes
