"""Parts one backend adds to the engine: nodes that join from anywhere (``launcher="external"``), and
the remote references RPC users attach updaters to. Each sees the engine's events (start, a worker
replaced or added, shutdown) through :class:`EngineExtra`'s methods, all no-ops by default."""

from __future__ import annotations

import logging
from typing import Any

from ...transport.join_keys import JoinKey, join_argv
from ...transport.torchdist_join import JoinWatcher
from .events import EventKind


__all__ = ["EngineExtra", "ExternalJoins", "RPCReferences"]

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

    def grown(self, count: int) -> None:
        """``count`` workers were added after the others."""

    def admit(self, fleet: Any) -> list[int]:
        """Between two batches: empty slots a worker joined meanwhile; returns them."""
        return []

    def stats(self) -> dict[str, Any]:
        """Figures this part adds to ``stats()``."""
        return {}

    def before_stop(self) -> None:
        """The workers are about to be stopped (they still answer)."""

    def after_stop(self) -> None:
        """The workers are stopped (or failed to start)."""


class ExternalJoins(EngineExtra):
    """``launcher="external"``: the key nodes read to join, the join command, slots filled again by the
    node that joins them (docs/elastic.md)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.key = None

    def before_start(self) -> None:
        network = self.engine.options.network
        self.key = JoinKey(network.authkey)
        # the join command goes to the log while slots wait for nodes
        self.engine.backend.open_joins(join_argv(network.advertised_host, network.tcp_port, self.key.path),
                                       JoinWatcher(self._joined, self._refused))

    def _joined(self, worker: int, host: str, address: str) -> None:
        # the join service logged it already
        self.engine.events.publish(EventKind.JOIN, f"a node joined slot {worker} from {host} ({address})",
                                   workers=(worker,), details={"host": host, "address": address})

    def _refused(self, who: str, reason: str) -> None:
        self.engine.events.publish(EventKind.JOIN_REFUSED, f"{who} was refused: {reason}", details={"reason": reason})

    def command(self) -> list[str]:
        """The argv a node runs to join.

        Raises:
            RuntimeError: after shutdown.
        """
        if self.engine.closed or self.key is None:
            raise RuntimeError(f"{self.engine.name} is shut down: no node can join it.")
        network = self.engine.options.network
        return join_argv(network.advertised_host, network.tcp_port, self.key.path)

    def admit(self, fleet: Any) -> list[int]:
        """Empty slots (their node left) that a node joined meanwhile take it back, through the
        replacement path (``Fleet.renew``: fresh trajectory ids, current weights and version)."""
        joins = getattr(self.engine.backend, "joins", None)
        requests = fleet.current_requests if fleet is not None else None
        if joins is None or requests is None or not requests.retired:
            return []
        rejoined = joins.joined(sorted(requests.retired))
        for worker in rejoined:  # its join was published when it joined (``_joined``)
            fleet.renew(worker)
            _log.info("a node took empty slot %d back", worker)
        return rejoined

    def after_stop(self) -> None:
        if self.key is not None:
            self.key.remove()


class RPCReferences(EngineExtra):
    """RPC users see one remote reference (``collector_rrefs``) and worker info (``collector_infos``) per
    node, e.g. to attach an ``RPCWeightUpdater``; they follow replacements and added nodes."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rrefs: list = []
        self.infos: list = []
        #: a replaced node's reference is deleted only once its agent is gone (deleting it now would
        #: message an owner that left the group)
        self._retired: list = []

    def _timeout(self) -> float:
        return self.engine.options.worker_timeout

    def after_start(self) -> None:
        handles = self.engine.requests.handles
        self.infos = [handle.info for handle in handles]
        self.rrefs = [handle.collector_rref(self._timeout()) for handle in handles]

    def before_replacement(self, worker: int) -> None:
        if worker < len(self.rrefs):
            self._retired.append(self.rrefs[worker])

    def after_replacement(self, worker: int) -> None:
        handle = self.engine.requests.handles[worker]  # a new RPC name: what users see follows it
        self.infos[worker] = handle.info
        self.rrefs[worker] = handle.collector_rref(self._timeout())

    def grown(self, count: int) -> None:
        for handle in self.engine.requests.handles[-count:]:
            self.infos.append(handle.info)
            self.rrefs.append(handle.collector_rref(self._timeout()))

    def before_stop(self) -> None:
        self.rrefs = []  # the nodes' references go while their owners still answer

    def after_stop(self) -> None:
        self.rrefs = []
        self._retired = []

