"""Minimal tensor specs: enough to describe an env's observations and actions and to draw random
actions. TorchRL's specs satisfy the same duck-typed interface (``shape``, ``dtype``, ``device``,
``rand()``, ``zero()``), so collectors accept either.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch
from tensordict import TensorDict
from tensordict.utils import NestedKey

from .._utils import as_tuple_key

__all__ = ["TensorSpec", "Unbounded", "Bounded", "Categorical", "OneHot", "Binary", "Composite"]


class SpecLike(Protocol):
    """What rlharvest reads of a leaf spec, its own (:class:`TensorSpec`) or TorchRL's."""

    shape: torch.Size
    dtype: torch.dtype


class CompositeLike(Protocol):
    """What rlharvest reads of a composite spec, its own (:class:`Composite`) or TorchRL's."""

    def items(self, include_nested: bool = False, leaves_only: bool = False) -> Iterator[tuple[Any, Any]]: ...


class TensorSpec:
    """A leaf spec: full ``shape`` (batch dims included), ``dtype`` and ``device``."""

    def __init__(self, shape=(), dtype: torch.dtype = torch.float32, device=None) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def zero(self, shape=None) -> torch.Tensor:
        """All-zero sample, with extra leading ``shape`` dims if given."""
        return torch.zeros((*torch.Size(shape or ()), *self.shape), dtype=self.dtype, device=self.device)

    def rand(self, shape=None) -> torch.Tensor:
        raise NotImplementedError

    def is_in(self, value: torch.Tensor) -> bool:
        return value.shape[-len(self.shape) :] == self.shape if self.shape else True

    def expand(self, *batch) -> TensorSpec:
        """A copy of this spec with ``batch`` dims prepended."""
        clone = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        clone.shape = torch.Size((*batch, *self.shape))
        return clone

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"


class Unbounded(TensorSpec):
    """Any real value; random samples are standard normal (integers: in [-100, 100))."""

    def rand(self, shape=None) -> torch.Tensor:
        full = (*torch.Size(shape or ()), *self.shape)
        if self.dtype.is_floating_point:
            return torch.randn(full, dtype=self.dtype, device=self.device)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, full, device=self.device).bool()
        return torch.randint(-100, 100, full, dtype=self.dtype, device=self.device)


class Bounded(TensorSpec):
    """Values in ``[low, high]`` (element-wise); random samples are uniform."""

    def __init__(self, low, high, shape=(), dtype=torch.float32, device=None) -> None:
        super().__init__(shape, dtype, device)
        self.low = torch.as_tensor(low, dtype=dtype, device=self.device).expand(self.shape).clone()
        self.high = torch.as_tensor(high, dtype=dtype, device=self.device).expand(self.shape).clone()

    def rand(self, shape=None) -> torch.Tensor:
        full = (*torch.Size(shape or ()), *self.shape)
        if self.dtype.is_floating_point:
            u = torch.rand(full, dtype=self.dtype, device=self.device)
            return self.low + u * (self.high - self.low)
        low, high = int(self.low.min()), int(self.high.max())
        return torch.randint(low, high + 1, full, dtype=self.dtype, device=self.device)

    def expand(self, *batch) -> Bounded:
        clone = super().expand(*batch)
        clone.low = self.low.expand(clone.shape).clone()
        clone.high = self.high.expand(clone.shape).clone()
        return clone

    def __eq__(self, other) -> bool:
        return (
            type(self) is type(other)
            and self.shape == other.shape
            and self.dtype == other.dtype
            and torch.equal(self.low, other.low)
            and torch.equal(self.high, other.high)
        )


class Categorical(TensorSpec):
    """Integer category in ``[0, n)``."""

    def __init__(self, n: int, shape=(), dtype=torch.int64, device=None) -> None:
        super().__init__(shape, dtype, device)
        self.n = int(n)

    def rand(self, shape=None) -> torch.Tensor:
        full = (*torch.Size(shape or ()), *self.shape)
        return torch.randint(0, self.n, full, dtype=self.dtype, device=self.device)


class OneHot(TensorSpec):
    """One-hot encoding over the last dim (``shape[-1] == n``)."""

    def __init__(self, n: int, shape=None, dtype=torch.bool, device=None) -> None:
        super().__init__((n,) if shape is None else shape, dtype, device)
        self.n = int(n)

    def rand(self, shape=None) -> torch.Tensor:
        full = (*torch.Size(shape or ()), *self.shape)
        index = torch.randint(0, self.n, full[:-1], device=self.device)
        return torch.nn.functional.one_hot(index, self.n).to(self.dtype)


class Binary(TensorSpec):
    """Independent 0/1 entries."""

    def __init__(self, n: int | None = None, shape=None, dtype=torch.int8, device=None) -> None:
        super().__init__((n,) if shape is None else shape, dtype, device)

    def rand(self, shape=None) -> torch.Tensor:
        full = (*torch.Size(shape or ()), *self.shape)
        return torch.randint(0, 2, full, device=self.device).to(self.dtype)


class Composite:
    """A mapping of nested keys to specs sharing leading ``shape`` (the env batch size)."""

    def __init__(self, specs: dict | None = None, shape=(), device=None, **kwargs) -> None:
        self.shape = torch.Size(shape)
        self.device = torch.device(device) if device is not None else None
        self._specs: dict[str, TensorSpec | Composite] = {}
        for key, spec in {**(specs or {}), **kwargs}.items():
            self[key] = spec

    def __setitem__(self, key: NestedKey, spec: TensorSpec | Composite) -> None:
        parts = as_tuple_key(key)
        if len(parts) > 1:
            sub = self._specs.setdefault(parts[0], Composite(shape=self.shape, device=self.device))
            sub[parts[1:]] = spec
        else:
            self._specs[parts[0]] = spec

    def __getitem__(self, key: NestedKey):
        parts = as_tuple_key(key)
        spec = self._specs[parts[0]]
        return spec[parts[1:]] if len(parts) > 1 else spec

    def __contains__(self, key: NestedKey) -> bool:
        try:
            self[key]
        except (KeyError, TypeError):
            return False
        return True

    def keys(self, include_nested: bool = False, leaves_only: bool = False) -> Iterator[NestedKey]:
        for name, spec in self._specs.items():
            if isinstance(spec, Composite):
                if not leaves_only:
                    yield name
                if include_nested:
                    for sub in spec.keys(True, leaves_only):
                        yield (name, *as_tuple_key(sub))
            else:
                yield name

    def items(self, include_nested: bool = False, leaves_only: bool = False):
        for key in self.keys(include_nested, leaves_only):
            yield key, self[key]

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def rand(self, shape=None) -> TensorDict:
        """A TensorDict of random samples for every leaf."""
        batch = (*torch.Size(shape or ()), *self.shape)
        return TensorDict({k: v.rand(shape) for k, v in self._specs.items()}, batch_size=batch)

    def zero(self, shape=None) -> TensorDict:
        batch = (*torch.Size(shape or ()), *self.shape)
        return TensorDict({k: v.zero(shape) for k, v in self._specs.items()}, batch_size=batch)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {v!r}" for k, v in self._specs.items())
        return f"Composite({inner}, shape={tuple(self.shape)})"
