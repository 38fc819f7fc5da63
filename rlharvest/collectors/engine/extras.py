"""Parts one backend adds to the engine, handed over by its options: nodes that join from anywhere
(``launcher="external"``), and the remote references RPC users attach updaters to. Each sees the
engine's events (start, a worker replaced or added, shutdown) through :class:`EngineExtra`'s methods,
all no-ops by default."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ...transport.join_keys import JoinKey, join_argv
from ...transport.torchdist_join import JoinService, JoinWatcher
from .events import EventKind, FleetEvents
from .fleet import Fleet
from .state import Lifecycle

__all__ = ["EngineExtra", "ExternalJoins", "RPCReferences", "JoiningBackend", "JoinAddress"]

_log = logging.getLogger("rlharvest")


class EngineExtra:
    """A backend's part of the engine; every event is a no-op unless overridden."""

    def before_start(self) -> None:
        """Before the workers start (the weight senders are set up)."""

    def after_start(self) -> None:
        """Once the workers started (and, unless deferred, are built)."""

    def before_replacement(self, worker: int) -> None:
        """``worker`` is about to be replaced, or leaves."""

    def after_replacement(self, worker: int) -> None:
        """``worker``'s replacement is built."""

    def check_add(self) -> None:
        """Raises: NotImplementedError when this part refuses ``add_collectors``."""

    def grown(self, count: int) -> None:
        """``count`` workers were added after the others."""

    def admit(self) -> list[int]:
        """Between two batches: empty slots a worker joined meanwhile; returns them."""
        return []

    def stats(self) -> dict[str, Any]:
        """Figures this part adds to ``stats()``."""
        return {}

    def before_stop(self) -> None:
        """The workers are about to be stopped (they still answer)."""

    def after_stop(self) -> None:
        """The workers are stopped (or failed to start)."""


class JoiningBackend(Protocol):
    """What :class:`ExternalJoins` asks of a backend whose nodes join (``TorchDistBackend``)."""

    joins: JoinService | None

    def open_joins(self, command: list[str] | None = None, watcher: JoinWatcher | None = None) -> None:
        """Listen for joining nodes from now on, the join ``command`` named in the log; ``watcher`` is told
        of each node that joins and each refused."""


class JoinAddress(Protocol):
    """Where joining nodes reach the collector, and the key they prove (``NetworkConfig``)."""

    authkey: bytes
    advertised_host: str
    tcp_port: int


class ExternalJoins(EngineExtra):
    """``launcher="external"``: the key nodes read to join, the join command, slots filled again by the
    node that joins them (docs/elastic.md), and the slots the autoscaler opens for nodes its
    ``on_scale`` asks for.

    Args:
        network: where nodes join, and the key they prove.
        backend: the backend taking joining nodes.
        fleet: the workers (an empty slot a node joined is renewed through the replacement path).
        life: the collector's name, and whether it is open.
        events: where each node that joins, and each refused, is published.
    """

    def __init__(self, network: JoinAddress, backend: JoiningBackend, fleet: Fleet, life: Lifecycle,
                 events: FleetEvents) -> None:
        self.network = network
        self.backend = backend
        self.fleet = fleet
        self.life = life
        self.events = events
        self.key: JoinKey | None = None
        #: slots opened for nodes the autoscaler asked ``on_scale`` for, not taken yet
        self.slots: list[int] = []

    def before_start(self) -> None:
        self.key = JoinKey(self.network.authkey)
        # the join command goes to the log while slots wait for nodes
        self.backend.open_joins(join_argv(self.network.advertised_host, self.network.tcp_port, self.key.path),
                                JoinWatcher(self._joined, self._refused))

    def _joined(self, worker: int, host: str, address: str) -> None:
        # the join service logged it already
        self.events.publish(EventKind.JOIN, f"a node joined slot {worker} from {host} ({address})",
                            workers=(worker,), details={"host": host, "address": address})

    def _refused(self, who: str, reason: str) -> None:
        self.events.publish(EventKind.JOIN_REFUSED, f"{who} was refused: {reason}", details={"reason": reason})

    def command(self) -> list[str]:
        """The argv a node runs to join.

        Raises:
            RuntimeError: after shutdown.
        """
        if self.life.closed or self.key is None:
            raise RuntimeError(f"{self.life.name} is shut down: no node can join it.")
        return join_argv(self.network.advertised_host, self.network.tcp_port, self.key.path)

    def check_add(self) -> None:
        raise NotImplementedError("launcher='external': the slots are the entries of create_env_fn, filled by the "
                                  "nodes that join (join_command()); add_collectors cannot add slots to it.")

    def admit(self) -> list[int]:
        """Empty slots (their node left) that a node joined meanwhile take it back, through the
        replacement path (``Fleet.renew``: fresh trajectory ids, current weights and version)."""
        joins = self.backend.joins
        requests = self.fleet.current_requests
        if joins is None or requests is None or not requests.retired:
            return []
        rejoined = joins.joined(sorted(requests.retired))
        for worker in rejoined:  # its join was published when it joined (``_joined``)
            self.fleet.renew(worker)
            _log.info("a node took empty slot %d back", worker)
        return rejoined

    # ------------------------------------------------------------------ slots the autoscaler opens
    def open_slots(self, wanted: int) -> None:
        """Open the slots ``wanted`` workers need beyond the current ones, empty slots counted first
        (their nodes join them back)."""
        requests = self.fleet.current_requests
        empty = len(requests.retired) if requests is not None else 0
        missing = wanted - len(self.fleet.active) - empty - len(self.slots)
        for _ in range(max(0, missing)):
            index = len(self.fleet) + len(self.slots)
            self.slots.append(index)
            self.backend.joins.want(index)

    def take_joined(self) -> int:
        """How many of the slots opened, in order, a node joined: they leave the list (the caller grows
        the collector by as many workers)."""
        if not self.slots:
            return 0
        joined = set(self.backend.joins.joined(self.slots))
        count = 0
        while count < len(self.slots) and self.slots[count] in joined:
            count += 1
        del self.slots[:count]
        return count

    def after_stop(self) -> None:
        if self.key is not None:
            self.key.remove()


class RPCReferences(EngineExtra):
    """RPC users see one remote reference (``collector_rrefs``) and worker info (``collector_infos``) per
    node, e.g. to attach an ``RPCWeightUpdater``; they follow replacements and added nodes.

    Args:
        fleet: the nodes.
        timeout: seconds to wait for a node's reference.
    """

    def __init__(self, fleet: Fleet, timeout: float) -> None:
        self.fleet = fleet
        self.timeout = timeout
        self.rrefs: list = []
        self.infos: list = []
        #: a replaced node's reference is deleted only once its agent is gone (deleting it now would
        #: message an owner that left the group)
        self._retired: list = []

    def after_start(self) -> None:
        handles = self.fleet.requests.handles
        self.infos = [handle.info for handle in handles]
        self.rrefs = [handle.collector_rref(self.timeout) for handle in handles]

    def before_replacement(self, worker: int) -> None:
        if worker < len(self.rrefs):
            self._retired.append(self.rrefs[worker])

    def after_replacement(self, worker: int) -> None:
        handle = self.fleet.requests.handles[worker]  # a new RPC name: what users see follows it
        self.infos[worker] = handle.info
        self.rrefs[worker] = handle.collector_rref(self.timeout)

    def grown(self, count: int) -> None:
        for handle in self.fleet.requests.handles[-count:]:
            self.infos.append(handle.info)
            self.rrefs.append(handle.collector_rref(self.timeout))

    def before_stop(self) -> None:
        self.rrefs = []  # the nodes' references go while their owners still answer

    def after_stop(self) -> None:
        self.rrefs = []
        self._retired = []
