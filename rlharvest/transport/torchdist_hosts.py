"""Which nodes share a remote host, and which of them carries each update there (docs/weights.md,
"One copy per host").

The weight sender of nodes (``torchdist_weights``) sends an update over the network once per remote
host: to one node of the host, its *carrier*, which receives it into a named shared-memory segment it
created (a *slot*); the host's other nodes then map that slot, as nodes on the main process's host
map the sender's own generations. This module keeps the bookkeeping: the hosts and their members,
the carrier of each, the slots of the carrier and which slot an update may be written into.

Two nodes share a host when they reached the main process from the same address, run on the same
kernel (boot id) and see the same ``/dev/shm`` (the device it is mounted from): containers of one
machine with separate ``/dev/shm`` count as separate hosts.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["HostKey", "RemoteHost", "RemoteHosts", "shm_identity", "valid_segment_name"]

#: (address the node connected from, boot id, identity of its /dev/shm)
HostKey = tuple[str, str, str]

_SEGMENT_NAME = re.compile(r"^rlh-w[0-9]+-[0-9a-f]{16}$")


def shm_identity() -> str:
    """What tells this machine's ``/dev/shm`` from another mount of it (empty when there is none)."""
    try:
        info = os.stat("/dev/shm")
    except OSError:
        return ""
    return f"{info.st_dev}:{info.st_ino}"


def valid_segment_name(name: Any) -> bool:
    """Whether ``name`` is a slot name as :meth:`RemoteHost.choose_slot` makes them
    (``rlh-w<carrier>-<16 hex digits>``): a node creates or maps nothing else under ``/dev/shm``."""
    return isinstance(name, str) and bool(_SEGMENT_NAME.match(name))


@dataclass(eq=False)
class RemoteHost:
    """The nodes of one remote host.

    Attributes:
        index: a number naming the host (slot ids are ``(index, n)``).
        members: the nodes connected from it.
        carrier: the node whose slots the host's nodes map, None before the first update.
        slots: ``slot id -> name`` of the carrier's slots (named here, created by the carrier).
        orphans: slot names of carriers that are gone, for the next carrier to remove.
        address: the address its nodes connected from.
    """

    index: int
    members: set[int] = field(default_factory=set)
    carrier: int | None = None
    slots: dict[tuple, str] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)
    address: str = ""
    _ids: Any = field(default_factory=itertools.count)

    def retire_carrier(self) -> None:
        """The carrier is gone (or replaced): its slots can no longer be written; the nodes that run
        on them keep their mappings, the names are removed by the next carrier."""
        self.orphans.extend(self.slots.values())  # also a slot it may have died creating
        self.slots.clear()
        self.carrier = None

    def choose_slot(self, busy: Iterable) -> tuple[tuple, bool]:
        """A slot of the carrier no node of the host runs on or waits for; ``(slot id, new)``. A new
        slot is named here, so that its name is known even if the carrier dies creating it."""
        busy = set(busy)
        for slot_id in self.slots:
            if slot_id not in busy:
                return slot_id, False
        slot_id = (self.index, next(self._ids))
        self.slots[slot_id] = f"rlh-w{self.carrier}-{secrets.token_hex(8)}"
        return slot_id, True


class RemoteHosts:
    """Every remote host of a sender, by :data:`HostKey`."""

    def __init__(self) -> None:
        self._by_key: dict[HostKey, RemoteHost] = {}
        self._of: dict[int, RemoteHost] = {}

    def join(self, worker: int, key: HostKey | None) -> None:
        """``worker`` connected from the host ``key`` (None: a host it shares with nobody we know)."""
        if key is None:
            return
        host = self._by_key.get(key)
        if host is None:
            host = self._by_key[key] = RemoteHost(len(self._by_key), address=key[0])
        host.members.add(worker)
        self._of[worker] = host

    def leave(self, worker: int) -> None:
        """``worker`` is gone: if it carried its host's updates, the next update picks another carrier."""
        host = self._of.pop(worker, None)
        if host is None:
            return
        host.members.discard(worker)
        if host.carrier == worker:
            host.retire_carrier()

    def host_of(self, worker: int) -> RemoteHost | None:
        return self._of.get(worker)

    def route(self, workers: list[int], min_shared: int = 2) -> tuple[list[int], dict[RemoteHost, list[int]]]:
        """``workers`` (remote nodes) split into those sent their own copy and, per host with
        ``min_shared`` or more of them, the nodes sharing one."""
        by_host: dict[RemoteHost, list[int]] = {}
        direct = []
        for worker in workers:
            host = self._of.get(worker)
            if host is None:
                direct.append(worker)
            else:
                by_host.setdefault(host, []).append(worker)
        shared = {}
        for host, targets in by_host.items():
            if len(targets) >= min_shared:
                shared[host] = targets
            else:
                direct.extend(targets)
        return sorted(direct), shared
