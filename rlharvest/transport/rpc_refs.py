"""Remote references to the collectors of RPC nodes (``RPCCollector.collector_rrefs``), reaching
each node by its name in the RPC group running now.

torch keeps one remote-reference context per process, bound to the first RPC agent the process ran;
an RRef resolves its owner's id through that agent's view of *its* group, also after later groups
replaced it. In a second RPC group of a process, a node whose id the first group never had, or had
removed (a replaced node leaves the membership), could not be found ("could not find destination id
2"; docs/restarts.md, "A second RPC group in the same process").
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed.rpc as rpc
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT

__all__ = ["NodeRRef"]


def _call_owned(rref, method: str, args: tuple, kwargs: dict) -> Any:
    """Runs on a node: ``method`` of the object ``rref`` (owned by the node) refers to."""
    return getattr(rref.local_value(), method)(*args, **kwargs)


def _same(rref):
    return rref


class NodeRRef:
    """The RRef to a node's collector, whose ``owner()``, ``rpc_sync()``, ``rpc_async()`` and
    ``remote()`` find the node by its name in the RPC group running now (see the module's doc).
    Anything else (``to_here()``, ``local_value()``, ...) is the RRef's; sent in an RPC, a
    ``NodeRRef`` travels as the RRef.

    Args:
        rref: the RRef (``rpc.remote(node, ...)``).
        owner_name: the node's RPC name.

    Example:
        >>> ref = collector.collector_rrefs[1]                               # doctest: +SKIP
        >>> ref.rpc_async().update_policy_weights_(weights).wait()           # doctest: +SKIP
    """

    def __init__(self, rref, owner_name: str) -> None:
        self.rref = rref
        self._owner_name = owner_name

    def owner_name(self) -> str:
        return self._owner_name

    def owner(self):
        return rpc.get_worker_info(self._owner_name)

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_OwnerCalls":
        return _OwnerCalls(self, rpc.rpc_sync, timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_OwnerCalls":
        return _OwnerCalls(self, rpc.rpc_async, timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_OwnerCalls":
        return _OwnerCalls(self, rpc.remote, timeout)

    def __getattr__(self, name: str) -> Any:
        if name == "rref":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.rref, name)

    def __reduce__(self):
        return _same, (self.rref,)

    def __repr__(self) -> str:
        return f"NodeRRef({self._owner_name})"


class _OwnerCalls:
    """``ref.rpc_async().method(*args)``: ``method`` of the referenced object, called on its owner."""

    def __init__(self, ref: NodeRRef, api: Callable, timeout: float) -> None:
        self._ref, self._api, self._timeout = ref, api, timeout

    def __getattr__(self, method: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._api(self._ref.owner_name(), _call_owned, args=(self._ref.rref, method, args, kwargs),
                             timeout=self._timeout)
        return call
