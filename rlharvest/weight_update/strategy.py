"""Weights as data: extracting them from modules, normalising the accepted forms, copying them in.

Weights travel as TensorDicts of parameters and buffers (nested by sub-module). Copies go through
``torch._foreach_copy_`` over the leaves, one fused call instead of one per tensor.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["WeightStrategy", "weights_of", "copy_weights_", "flat_leaves"]


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


def flat_leaves(td: TensorDictBase) -> tuple[list, list[torch.Tensor]]:
    """Sorted leaf keys and their tensors (a deterministic order shared by both ends of a transfer)."""
    keys = sorted(td.keys(True, True), key=lambda k: (k,) if isinstance(k, str) else k)
    return keys, [td.get(k) for k in keys]


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
    for (owner, name, is_parameter), tensor in zip(_binding(module, tuple(keys)), leaves):
        if is_parameter:
            owner._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[name] = tensor


def copy_weights_(dest: TensorDictBase, source: TensorDictBase) -> None:
    """Copy ``source`` into ``dest`` in place, leaf by leaf.

    Raises:
        KeyError: when the two key sets differ, listing both.
    """
    dest_keys, dest_leaves = flat_leaves(dest)
    source_keys, source_leaves = flat_leaves(source)
    if dest_keys != source_keys:
        raise KeyError(
            f"Weight keys do not match the destination.\ndestination keys: {dest_keys}\nweight keys: {source_keys}"
        )
    pairs = [(d, s) for d, s in zip(dest_leaves, source_leaves) if d.data_ptr() != s.data_ptr() or d.device != s.device]
    if not pairs:
        return
    with torch.no_grad():
        dst, src = zip(*pairs)
        torch._foreach_copy_(list(dst), [s.to(d.device, d.dtype) if s.device != d.device else s for d, s in pairs])


class WeightStrategy:
    """How a scheme extracts and applies weights (SPEC §6.6).

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
        if isinstance(destination, torch.nn.Module):
            if inplace:
                copy_weights_(TensorDict.from_module(destination), weights)
            else:
                swap_weights(destination, weights)
            return
        if isinstance(destination, (TensorDictBase, dict)):
            if not inplace:
                raise ValueError("Out-of-place weight application needs an nn.Module destination.")
            copy_weights_(weights_of(destination), weights)
            return
        if weights.is_empty():
            return
        raise ValueError(f"Cannot apply weights to a {type(destination).__name__}.")
