"""One contiguous byte buffer holding every leaf of a TensorDict.

A process group moves one tensor per message, so a batch or a weight set travels as one flat
``uint8`` buffer; both ends build TensorDict *views* into their own flat buffer from the same
:class:`FlatLayout` (keys, dtypes, shapes, offsets), agreed once. Writing into the views fills the
buffer; no packing copy is needed when the producer writes into the views directly.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase

from ..errors import WeightNamesError, WeightShapeError

__all__ = ["FlatBatch", "FlatLayout", "FlatUnpacker", "check_same_leaves", "copy_leaves_", "dotted_key", "flat_leaves",
           "freeze", "is_frozen", "is_dense"]

#: every leaf starts on a cache line: a copy into a buffer whose leaves straddle lines is ~1.5x
#: slower when the buffer is out of cache, as weight buffers are between two updates (docs/weights.md)
_ALIGN = 64


def is_dense(td: TensorDictBase) -> bool:
    """Whether every entry of ``td`` is a tensor of fixed shape (in plain TensorDicts): what a flat
    buffer or a shared-memory batch buffer can hold. Non-tensor data and lazily stacked
    (heterogeneous, or dynamic-shape) TensorDicts are not."""
    entry = _FROZEN.get(id(td))
    if entry is not None and entry[0]() is td:
        return entry[3]
    return _is_dense(td)


def _is_dense(td: TensorDictBase) -> bool:
    from tensordict import is_tensor_collection

    if type(td) is not TensorDict:
        return False
    return not any(is_tensor_collection(v) and type(v) is not TensorDict for v in td.values(True))


def _sorted_leaves(td: TensorDictBase) -> list:
    keys = list(td.keys(True, True))
    return sorted(keys, key=lambda k: (k,) if isinstance(k, str) else tuple(k))


#: what is known of frozen TensorDicts: id -> (weak reference, sorted keys, their leaves, is_dense)
_FROZEN: dict[int, tuple[weakref.ref, list, list[torch.Tensor], bool]] = {}


def freeze(td: TensorDictBase) -> TensorDictBase:
    """Lock ``td`` (its keys can no longer change) and remember its sorted leaves.

    For TensorDicts that weight updates pass again and again (weight generations, module snapshots):
    :func:`flat_leaves` and :func:`is_dense` of a frozen TensorDict are a dict lookup instead of
    walking its entries (~10 us each in a tight loop, 40 us between two updates).
    """
    td.lock_()
    keys = _sorted_leaves(td)
    leaves = [td.get(k) for k in keys]
    key = id(td)
    _FROZEN[key] = (weakref.ref(td, lambda _, key=key: _FROZEN.pop(key, None)), keys, leaves, _is_dense(td))
    return td


def is_frozen(td: TensorDictBase) -> bool:
    entry = _FROZEN.get(id(td))
    return entry is not None and entry[0]() is td


def flat_leaves(td: TensorDictBase) -> tuple[list, list[torch.Tensor]]:
    """Sorted leaf keys and their tensors (a deterministic order shared by both ends of a transfer)."""
    entry = _FROZEN.get(id(td))
    if entry is not None and entry[0]() is td:
        return entry[1], entry[2]
    keys = _sorted_leaves(td)
    return keys, [td.get(k) for k in keys]


def copy_leaves_(dest: TensorDictBase, source: TensorDictBase) -> None:
    """Copy ``source`` into ``dest`` in place, leaf by leaf (one fused copy; leaves already shared are skipped).

    Raises:
        WeightNamesError: when the two key sets differ. WeightShapeError: when a leaf's shape differs
            (torch would broadcast a smaller one into it).
    """
    dest_keys, dest_leaves = flat_leaves(dest)
    source_keys, source_leaves = flat_leaves(source)
    check_same_leaves(dest_keys, dest_leaves, source_keys, source_leaves, "the destination")
    pairs = [(d, s) for d, s in zip(dest_leaves, source_leaves) if d.data_ptr() != s.data_ptr() or d.device != s.device]
    if not pairs:
        return
    with torch.no_grad():
        dst, src = zip(*pairs)
        torch._foreach_copy_(list(dst), [s.to(d.device, d.dtype) if s.device != d.device else s for d, s in pairs])


def check_same_leaves(dest_keys: list, dest_leaves: list[torch.Tensor], keys: list, leaves: list[torch.Tensor],
                      dest_name: str) -> None:
    """Raise unless the weights ``keys``/``leaves`` (sorted, :func:`flat_leaves`) fit ``dest_name``'s:
    the same names, and each tensor of the same shape. The message lists what differs, a line each.

    Raises:
        WeightNamesError: names missing from the weights, or extra ones. WeightShapeError: each name
            whose shapes differ, with both shapes.
    """
    if dest_keys != keys:
        wanted, given = {dotted_key(k) for k in dest_keys}, {dotted_key(k) for k in keys}
        lines = [f"  missing: {', '.join(sorted(wanted - given))}" if wanted - given else "",
                 f"  extra: {', '.join(sorted(given - wanted))}" if given - wanted else ""]
        raise WeightNamesError(f"The weights given do not fit {dest_name}, whose names differ:\n"
                               + "\n".join(line for line in lines if line))
    wrong = [f"  {dotted_key(key)}: shape {list(given.shape)} given, {list(wanted.shape)} expected"
             for key, wanted, given in zip(keys, dest_leaves, leaves) if wanted.shape != given.shape]
    if wrong:
        raise WeightShapeError(f"The weights given do not fit {dest_name}, whose shapes differ:\n" + "\n".join(wrong))


def dotted_key(key: str | tuple) -> str:
    """A TensorDict key as a state_dict names it (``("module", "weight")`` -> ``"module.weight"``)."""
    return key if isinstance(key, str) else ".".join(key)


@dataclass(frozen=True)
class FlatLayout:
    """Where each leaf lives in the flat buffer.

    Example:
        >>> td = TensorDict({"a": torch.arange(3), ("b", "c"): torch.ones(2, 2)}, [])
        >>> layout = FlatLayout.of(td)
        >>> flat, view = layout.allocate()
        >>> view.update_(td)["b", "c"].sum().item(), flat.dtype
        (4.0, torch.uint8)
    """

    entries: tuple[tuple, ...]  # (key, dtype, shape, offset, nbytes)
    batch_size: tuple[int, ...]
    names: tuple | None
    total_bytes: int

    def __post_init__(self) -> None:
        """Every layout is one :meth:`of` could have made, whoever made it (a node announces its
        batches' layout): a batch size and names TensorDicts take, leaves in key order, each of its
        dtype's size, aligned, none overlapping another or past ``total_bytes``.

        Raises:
            ValueError: naming the first thing wrong.
        """
        problem = _layout_problem(self)
        if problem:
            raise ValueError(f"not a batch layout: {problem}")

    @classmethod
    def of(cls, td: TensorDictBase) -> FlatLayout:
        entries, offset = [], 0
        for key in _sorted_leaves(td):
            leaf = td.get(key)
            nbytes = leaf.numel() * leaf.element_size()
            entries.append((key, leaf.dtype, tuple(leaf.shape), offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        names = None
        try:
            if td.names is not None and any(n is not None for n in td.names):
                names = tuple(td.names)
        except Exception:  # some TensorDict types have no names
            names = None
        return cls(tuple(entries), tuple(td.batch_size), names, max(offset, _ALIGN))

    def view(self, flat: torch.Tensor) -> TensorDictBase:
        """A TensorDict whose leaves are views into ``flat``."""
        leaves = {}
        for key, dtype, shape, offset, nbytes in self.entries:
            leaves[key] = flat[offset : offset + nbytes].view(dtype).view(shape)
        td = TensorDict(leaves, batch_size=self.batch_size, device=flat.device)
        if self.names is not None:
            td.refine_names(*self.names)
        return td

    def allocate(self, device=None, shared: bool = False, zeroed: bool = True) -> tuple[torch.Tensor, TensorDictBase]:
        """A flat buffer and its TensorDict view; ``zeroed=False`` for a buffer written whole before it
        is read (a batch received from a node): its memory is only touched as the bytes arrive."""
        flat = (torch.zeros if zeroed else torch.empty)(self.total_bytes, dtype=torch.uint8, device=device)
        if shared:
            flat.share_memory_()
        return flat, self.view(flat)

    def describe(self) -> str:
        return ", ".join(f"{k}: {tuple(s)} {d}" for k, d, s, _, _ in self.entries)


def _is_dims(value) -> bool:
    return type(value) is tuple and all(type(n) is int and n >= 0 for n in value)


def _sort_key(key) -> tuple | None:
    if type(key) is str:
        return (key,)
    if type(key) is tuple and key and all(type(part) is str for part in key):
        return key
    return None


def _layout_problem(layout: FlatLayout) -> str:
    """What makes ``layout`` inconsistent (see :meth:`FlatLayout.__post_init__`), or ``""``."""
    batch_size, names = layout.batch_size, layout.names
    if not _is_dims(batch_size):
        return f"batch size {batch_size!r:.80}"
    if names is not None:
        given = [name for name in names if name is not None] if type(names) is tuple else None
        if given is None or len(names) != len(batch_size) or len(set(given)) != len(given) or \
                not all(type(name) is str for name in given):
            return f"names {names!r:.80} for batch size {batch_size}"
    if type(layout.total_bytes) is not int or layout.total_bytes < _ALIGN or type(layout.entries) is not tuple:
        return f"total bytes {layout.total_bytes!r:.40}"
    end, previous = 0, None
    for entry in layout.entries:
        if type(entry) is not tuple or len(entry) != 5:
            return f"entry {entry!r:.80}"
        key, dtype, shape, offset, nbytes = entry
        order = _sort_key(key)
        if order is None or (previous is not None and (order <= previous or order[:len(previous)] == previous)):
            return f"key {key!r:.80} out of order, repeated or under a leaf"
        if not isinstance(dtype, torch.dtype) or not _is_dims(shape) or shape[:len(batch_size)] != batch_size:
            return f"{key!r:.80}: dtype {dtype!r:.40}, shape {shape!r:.80} for batch size {batch_size}"
        if type(offset) is not int or offset < end or offset % _ALIGN or type(nbytes) is not int or \
                nbytes != math.prod(shape) * dtype.itemsize or offset + nbytes > layout.total_bytes:
            return f"{key!r:.80}: {nbytes!r:.20} bytes at {offset!r:.20} (after {end}, in {layout.total_bytes})"
        end, previous = offset + nbytes, order
    return ""


class FlatBatch:
    """A dense CPU TensorDict packed as one byte array and its :class:`FlatLayout`: what a batch
    travels as when it is pickled (Ray replies).

    Pickling a TensorDict pickles each leaf through torch's own reducer, a ``torch.save`` per
    storage: ~0.1-0.2 ms per leaf to load, on the receiving side, for every worker and every batch
    (the learner of a Ray collector spent most of its time there). A numpy array pickles as one
    buffer (out of band with pickle protocol 5, as Ray uses), and the layout is a small tuple.

    Example:
        >>> import pickle
        >>> td = TensorDict({"a": torch.arange(3), ("b", "c"): torch.ones(3, 2)}, [3], names=["time"])
        >>> packed = pickle.loads(pickle.dumps(FlatBatch.of(td)))
        >>> out = packed.unpack()
        >>> bool((out == td).all()), out.names, out.device
        (True, ['time'], None)
    """

    __slots__ = ("layout", "device", "data")

    def __init__(self, layout: FlatLayout, device: torch.device | None, data) -> None:
        self.layout = layout
        self.device = device
        self.data = data  # numpy uint8 array of layout.total_bytes

    @classmethod
    def packable(cls, td: TensorDictBase) -> bool:
        """Whether ``td`` can be packed: dense (see :func:`is_dense`), on the CPU, no leaf needing grad."""
        if not is_dense(td) or (td.device is not None and td.device.type != "cpu"):
            return False
        return all(leaf.device.type == "cpu" and not leaf.requires_grad for leaf in flat_leaves(td)[1])

    @classmethod
    def of(cls, td: TensorDictBase) -> FlatBatch:
        """A private packed copy of ``td`` (which must be :meth:`packable`)."""
        layout = FlatLayout.of(td)
        flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)  # zeroed: no stale bytes between leaves
        for key, dtype, shape, offset, nbytes in layout.entries:
            flat[offset : offset + nbytes].view(dtype).view(shape).copy_(td.get(key))
        return cls(layout, td.device, flat.numpy())

    def unpack(self) -> TensorDictBase:
        """A TensorDict of private (writable) tensors, equal to the packed one: same keys, dtypes,
        shapes, batch size, names and device."""
        return FlatUnpacker().unpack(self)

    def __reduce__(self):
        return FlatBatch, (self.layout, self.device, self.data)


class FlatUnpacker:
    """Unpacks :class:`FlatBatch` es of one source, keeping a buffer and its TensorDict view for the
    last layout seen: each batch is then one copy into that buffer and a ``clone()`` of the view
    (~30 us for a 9-leaf batch), instead of building a TensorDict of views (~120 us: key checks,
    names) per batch."""

    def __init__(self) -> None:
        self._key: tuple | None = None  # (layout, device) of the buffer
        self._flat: torch.Tensor | None = None
        self._view: TensorDictBase | None = None

    def unpack(self, packed: FlatBatch) -> TensorDictBase:
        """A private copy of ``packed`` (see :meth:`FlatBatch.unpack`)."""
        key = (packed.layout, packed.device)
        if key != self._key:
            self._flat, self._view = packed.layout.allocate()
            if packed.device is None:
                self._view.clear_device_()
            self._key = key
        self._flat.numpy()[:] = packed.data  # what was unpickled may be read-only (Ray's buffers)
        return self._view.clone()
