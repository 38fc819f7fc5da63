"""Weights as data: extracting them from modules, normalising the accepted forms, copying them in.

Weights travel as TensorDicts of parameters and buffers (nested by sub-module). Copies go through
``torch._foreach_copy_`` over the leaves, one fused call instead of one per tensor.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ..data.flat import copy_leaves_ as copy_weights_, flat_leaves, freeze, is_frozen

__all__ = ["WeightStrategy", "weights_of", "module_weights", "copy_weights_", "flat_leaves", "materialize"]


def weights_of(source: Any) -> TensorDictBase:
    """Parameters and buffers of a module, or a TensorDict/dict of weights, as a TensorDict.

    Dotted keys of a plain dict (``{"0.weight": w}``) are unflattened. The returned TensorDict holds
    the module's live tensors (no copy), detached from autograd.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(source, torch.nn.Module):
        return TensorDict.from_module(source).detach()
    if isinstance(source, TensorDictBase):
        return source
    if isinstance(source, dict):
        td = TensorDict({k: v for k, v in source.items()}, batch_size=[])
        if any(isinstance(k, str) and "." in k for k in source):
            td = td.unflatten_keys(".")
        return td
    raise TypeError(
        f"Weights must be an nn.Module, a TensorDict or a dict of tensors, got {type(source).__name__}"
    )


_MODULE_WEIGHTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def module_weights(module: torch.nn.Module) -> TensorDictBase:
    """``weights_of(module)`` as a frozen (locked) view of its live tensors, cached per module.

    A sender reads its policy's weights at every update; rebuilding the TensorDict costs ~80 us. The
    cached one is reused while the module holds the same tensor objects at the same addresses
    (in-place changes show through it: it is a view); a replaced parameter or ``.data`` rebuilds it.
    """
    tensors = [t for m in module.modules() for t in itertools.chain(m._parameters.values(), m._buffers.values())
               if t is not None]
    fingerprint = [(id(t), t.data_ptr()) for t in tensors]
    cached = _MODULE_WEIGHTS.get(module)
    if cached is not None and cached[0] == fingerprint:
        return cached[2]
    td = freeze(weights_of(module))
    _MODULE_WEIGHTS[module] = (fingerprint, tensors, td)  # holding the tensors keeps their ids unique
    return td


_BINDINGS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _binding(module: torch.nn.Module, keys: tuple) -> list[tuple]:
    """``(submodule, attribute, is_parameter)`` for each weight key (cached per module and key set)."""
    per_module = _BINDINGS.setdefault(module, {})
    binding = per_module.get(keys)
    if binding is None:
        binding = []
        for key in keys:
            parts = (key,) if isinstance(key, str) else tuple(key)
            owner = module
            for name in parts[:-1]:
                owner = getattr(owner, name)
            name = parts[-1]
            if name in owner._parameters:
                binding.append((owner, name, True))
            elif name in owner._buffers:
                binding.append((owner, name, False))
            else:
                raise KeyError(f"{'.'.join(parts)} is neither a parameter nor a buffer of {type(module).__name__}")
        per_module[keys] = binding
    return binding


def swap_weights(module: torch.nn.Module, weights: TensorDictBase) -> None:
    """Make ``module`` use the tensors of ``weights`` (no copy). Parameters stay ``nn.Parameter``.

    Raises:
        KeyError: when a weight key is not a parameter or buffer of the module.
    """
    keys, leaves = flat_leaves(weights)
    binding = _binding(module, tuple(keys))
    if is_frozen(weights):
        swapped = _swapped_tensors(module, weights, binding, leaves)
    else:
        swapped = _as_module_tensors(binding, leaves)
    for (owner, name, is_parameter), tensor in zip(binding, swapped):
        if is_parameter:
            owner._parameters[name] = tensor
        else:
            owner._buffers[name] = tensor


def _as_module_tensors(binding: list[tuple], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.Parameter(t, requires_grad=False) if is_parameter else t
            for (_, _, is_parameter), t in zip(binding, leaves)]


#: per module: id(locked weights) -> (ref, the Parameters/buffers the module was given for them)
_SWAPPED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _swapped_tensors(module: torch.nn.Module, weights: TensorDictBase, binding: list[tuple],
                     leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Parameters a module was given the last time it swapped in these (frozen) weights.

    Workers alternate between a few weight generations, so swapping one in again costs a few dict
    writes instead of building a Parameter per leaf.
    """
    per_module = _SWAPPED.setdefault(module, {})
    entry = per_module.get(id(weights))
    if entry is not None and entry[0]() is weights:
        return entry[1]
    for stale in [k for k, (ref, _) in per_module.items() if ref() is None]:
        del per_module[stale]
    swapped = _as_module_tensors(binding, leaves)
    per_module[id(weights)] = (weakref.ref(weights), swapped)
    return swapped


class WeightStrategy:
    """How a scheme extracts and applies weights (docs/weights.md, "Strategies").

    With ``"tensordict"``, a module that defines ``get_extra_state()`` (running statistics kept
    outside its parameters and buffers) has that state under ``"__extra_state__"``, and
    :meth:`apply_weights` gives it back to the destination's ``set_extra_state()``.

    Args:
        extract_as: ``"tensordict"`` (default) or ``"state_dict"`` (experimental).

    Example:
        >>> strategy = WeightStrategy()
        >>> module = torch.nn.Linear(2, 2)
        >>> weights = strategy.extract_weights(module)
        >>> strategy.apply_weights(module, weights.apply(torch.zeros_like))
        >>> float(module.weight.abs().sum())
        0.0
    """

    def __init__(self, extract_as: str = "tensordict") -> None:
        if extract_as not in ("tensordict", "state_dict"):
            raise ValueError(f"extract_as must be 'tensordict' or 'state_dict', got {extract_as!r}")
        if extract_as == "state_dict":
            warnings.warn("WeightStrategy(extract_as='state_dict') is experimental.", UserWarning)
        self.extract_as = extract_as

    def extract_weights(self, source: Any):
        """Weights of ``source`` in this strategy's format (empty with a warning if unsupported)."""
        if isinstance(source, (torch.nn.Module, TensorDictBase, dict)):
            td = weights_of(source)
            if self.extract_as == "state_dict":
                return dict(td.flatten_keys(".").items())
            extra = _extra_state_of(source) if isinstance(source, torch.nn.Module) else None
            if extra:  # what the module keeps outside its parameters and buffers (running statistics)
                td.set(EXTRA_STATE, TensorDict(dict(extra), batch_size=[]))
            return td
        warnings.warn(f"Cannot extract weights from {type(source).__name__}; returning empty weights.")
        return {} if self.extract_as == "state_dict" else TensorDict({}, batch_size=[])

    def apply_weights(self, destination: Any, weights: Any, inplace: bool = True) -> None:
        """Write ``weights`` into ``destination`` (a module, TensorDict or dict).

        ``inplace=False`` on a module swaps its tensors for the given ones (zero-copy attachment).

        Raises:
            ValueError: for a destination that cannot hold weights, or an out-of-place dict update.
            KeyError: when keys differ.
        """
        if weights is None:
            return
        weights = weights_of(weights)
        extra = None
        if EXTRA_STATE in weights.keys():  # (the given weights keep it: they may be applied again)
            extra = weights.get(EXTRA_STATE).clone().flatten_keys(".").to_dict()
            weights = weights.exclude(EXTRA_STATE)
        if isinstance(destination, torch.nn.Module):
            if inplace:
                copy_weights_(TensorDict.from_module(destination), weights)
            else:
                swap_weights(destination, weights)
            if extra is not None:
                destination.set_extra_state(extra)
            return
        if isinstance(destination, (TensorDictBase, dict)):
            if not inplace:
                raise ValueError("Out-of-place weight application needs an nn.Module destination.")
            copy_weights_(weights_of(destination), weights)
            return
        if weights.is_empty():
            return
        raise ValueError(f"Cannot apply weights to a {type(destination).__name__}.")


#: the key under which ``WeightStrategy.extract_weights`` keeps a module's ``get_extra_state()``
EXTRA_STATE = "__extra_state__"


def _extra_state_of(module: torch.nn.Module) -> Any:
    """``module.get_extra_state()`` when the module defines it (a mapping of tensors), else None."""
    if type(module).get_extra_state is torch.nn.Module.get_extra_state:
        return None
    try:
        extra = module.get_extra_state()
    except RuntimeError:
        return None
    return extra if isinstance(extra, Mapping) else None


def materialize(model: torch.nn.Module, weights: TensorDictBase, device=None) -> None:
    """Give ``model`` private tensors holding ``weights`` (works for meta-device 'stateless' models)."""
    current = TensorDict.from_module(model)
    if any(t.is_meta for t in current.values(True, True)):
        device = device or next((t.device for t in weights.values(True, True)), torch.device("cpu"))
        model.to_empty(device=device)
        current = TensorDict.from_module(model)
    copy_weights_(current.detach(), weights)
