"""The caches that make a weight update cheap must never serve stale weights or stale keys."""

from __future__ import annotations

import gc

import pytest
import torch
from tensordict import TensorDict

from rlharvest.data.flat import FlatLayout, flat_leaves, freeze, is_dense, is_frozen
from rlharvest.weight_update.strategy import module_weights, swap_weights, weights_of

pytestmark = pytest.mark.timeout(30)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def generation_of(module: torch.nn.Module, fill: float) -> TensorDict:
    """What a weight pool hands out: a frozen view of a flat buffer holding ``fill`` everywhere."""
    layout = FlatLayout.of(weights_of(module))
    _, view = layout.allocate()
    view.apply_(lambda t: t.fill_(fill))
    return freeze(view)


def test_flat_leaves_of_a_plain_tensordict_follow_its_changes():
    td = TensorDict({"b": torch.zeros(2), "a": torch.ones(1)}, [])
    assert flat_leaves(td)[0] == ["a", "b"]
    td["c"] = torch.zeros(3)
    replaced = torch.full((2,), 5.0)
    td["b"] = replaced
    keys, leaves = flat_leaves(td)
    assert keys == ["a", "b", "c"] and leaves[1] is replaced
    assert not is_frozen(td)


def test_a_frozen_tensordict_is_locked_and_its_leaves_are_cached():
    td = freeze(TensorDict({"b": torch.zeros(2), ("x", "a"): torch.ones(1)}, []))
    assert td.is_locked and is_frozen(td)
    first = flat_leaves(td)
    assert first[0] == ["b", ("x", "a")]
    assert flat_leaves(td)[1] is first[1]
    with pytest.raises(RuntimeError):
        td["c"] = torch.zeros(1)  # its keys cannot change behind the cache


def test_the_frozen_registry_forgets_dead_tensordicts():
    from rlharvest.data import flat

    td = freeze(TensorDict({"a": torch.zeros(1)}, []))
    key = id(td)
    assert key in flat._FROZEN
    del td
    gc.collect()
    assert key not in flat._FROZEN
    other = TensorDict({"a": torch.zeros(1)}, [])
    assert not is_frozen(other)  # even if it got the dead one's id


def test_module_weights_is_a_cached_live_view():
    module = mlp()
    first = module_weights(module)
    assert module_weights(module) is first and first.is_locked
    with torch.no_grad():
        module[0].weight.add_(1.0)  # in-place: seen through the same view
    assert torch.equal(module_weights(module)["0", "weight"], module[0].weight)
    assert module_weights(module) is first


@pytest.mark.parametrize("change", ["new_parameter", "data", "new_buffer"])
def test_module_weights_is_rebuilt_when_the_module_holds_other_tensors(change):
    module = mlp()
    first = module_weights(module)
    if change == "new_parameter":
        module[0].weight = torch.nn.Parameter(torch.full((4, 3), 7.0))
        expected = ("0", "weight"), 7.0
    elif change == "data":
        module[2].bias.data = torch.full((2,), 3.0)
        expected = ("2", "bias"), 3.0
    else:
        module[1].running_mean = torch.full((4,), 2.0)
        expected = ("1", "running_mean"), 2.0
    fresh = module_weights(module)
    assert fresh is not first
    key, value = expected
    assert (fresh[key] == value).all()


def test_swapping_generations_back_and_forth_reuses_parameters_and_keeps_values():
    module = mlp()
    gen_a, gen_b = generation_of(module, 1.0), generation_of(module, 2.0)
    swap_weights(module, gen_a)
    param_a = module[0].weight
    assert isinstance(param_a, torch.nn.Parameter) and not param_a.requires_grad
    for _ in range(3):
        swap_weights(module, gen_b)
        assert (module[0].weight == 2.0).all() and (module[1].running_var == 2.0).all()
        gen_a.apply_(lambda t: t.add_(1))  # the sender writes the generation no one uses
        swap_weights(module, gen_a)
        assert module[0].weight is param_a  # the same Parameter object, no rebuild
        assert (module[2].bias == gen_a["2", "bias"]).all()
    assert module[0].weight.data_ptr() == gen_a["0", "weight"].data_ptr()  # no copy


def test_swapping_a_plain_tensordict_builds_new_parameters_each_time():
    module = mlp()
    weights = weights_of(module).apply(lambda t: torch.full_like(t, 4.0))
    swap_weights(module, weights)
    first = module[0].weight
    weights["0", "weight"] = torch.full((4, 3), 5.0)  # a plain TensorDict may change between swaps
    swap_weights(module, weights)
    assert module[0].weight is not first and (module[0].weight == 5.0).all()


def test_one_generation_swapped_into_two_modules_gives_each_its_own_parameters():
    first, second = mlp(), mlp()
    generation = generation_of(first, 6.0)
    swap_weights(first, generation)
    swap_weights(second, generation)
    assert first[0].weight is not second[0].weight
    assert first[0].weight.data_ptr() == second[0].weight.data_ptr()


@pytest.mark.parametrize("allocator", ["torch", "named"])
def test_every_tensor_of_a_generation_starts_on_a_cache_line(allocator):
    from rlharvest.transport.weight_pool import GenerationPool, NamedShmAllocator, TorchShmAllocator

    # odd sizes (996 floats is not a multiple of 64 bytes) and mixed dtypes
    weights = TensorDict({"a": torch.zeros(996), "b": torch.zeros(3, dtype=torch.uint8),
                          "c": torch.zeros(5, 7, dtype=torch.float64), "d": torch.zeros(996, 4)}, [])
    pool = GenerationPool(FlatLayout.of(weights), TorchShmAllocator() if allocator == "torch" else NamedShmAllocator())
    try:
        generation, _ = pool.acquire(set())
        assert [leaf.data_ptr() % 64 for leaf in generation.leaves] == [0, 0, 0, 0]
    finally:
        pool.close()


def test_a_frozen_tensordict_keeps_whether_it_is_dense():
    from tensordict import NonTensorData

    dense = freeze(TensorDict({"a": torch.zeros(2), "b": {"c": torch.ones(1)}}, []))
    mixed = freeze(TensorDict({"a": torch.zeros(2), "note": NonTensorData("x")}, []))
    assert is_dense(dense) and not is_dense(mixed)
    assert is_dense(TensorDict({"a": torch.zeros(2)}, [])) and not is_dense(TensorDict({"n": NonTensorData(1)}, []))
