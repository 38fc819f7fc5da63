"""Weight-sync schemes: one object, two roles (docs/weights.md).

The *sender* lives in the collector that owns workers; pickled copies of the same object become the
*receivers* inside the workers. A scheme moves one model. The life cycle is

    init_on_sender -> connect -> send ...        (sender)
    init_on_receiver -> connect -> receive ...   (receiver)

and every scheme sits on a transport (``rlharvest.transport``): the sender holds a
:class:`~rlharvest.transport.base.WeightSender`, each receiver a
:class:`~rlharvest.transport.base.WeightReceiver`. This base class implements the life cycle, the
argument resolution and the cascading; subclasses only say which transport to build.

Versions: every ``send`` carries a new version number; receivers apply, cascade to their own workers,
then acknowledge with that version, and ``send`` returns once every targeted worker acknowledged.
A worker started after the others (a replacement) gets a receiver of its own: ``replace`` before
it starts, ``attach`` after, and it runs the current weights before it collects.

What a scheme needs from the collector it serves is written down in ``context.py``:
:class:`SenderContext` on the parent's side, :class:`ReceiverContext` inside a worker. A scheme reads
nothing else of it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from tensordict import TensorDictBase

from ..errors import RemoteFailure
from ..transport.base import WeightLinks, WeightReceiver, WeightSender
from .backends import scheme_class
from .context import ReceiverContext, SenderContext
from .payloads import payload_of, resolve_worker_ids
from .strategy import WeightStrategy, materialize, weights_of

__all__ = ["WeightSyncScheme", "NoWeightSyncScheme", "SenderContext", "ReceiverContext"]

#: what a pickled copy (the scheme a worker is given) leaves out: its role is set up where it lands
_PICKLE_DROPPED = ("_context_ref", "_model_ref", "_sender", "_receiver", "initialized_on_sender",
                   "initialized_on_receiver", "synchronized_on_sender", "synchronized_on_receiver",
                   "_last_payload", "_receiver_links")


def _weak(obj: Any):
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class WeightSyncScheme:
    """Base class of weight-sync schemes.

    Args:
        strategy: ``"tensordict"`` (default), ``"state_dict"`` or a :class:`WeightStrategy`.
        sync: whether ``send`` waits for every targeted worker's acknowledgement.
        timeout: seconds to wait for acknowledgements (and for initial weights on the receiver).

    Example:
        >>> scheme = NoWeightSyncScheme()
        >>> scheme.init_on_sender(model_id="policy")
        >>> scheme.connect()
        >>> scheme.send()  # nothing to do
    """

    #: whether ``{worker_idx: weights}`` payloads are understood
    supports_per_worker_weights = False
    #: whether the sender talks to workers of its collector (a leaf Collector has none)
    needs_workers = False
    #: receiver side: what the worker's transport offers (``use_receiver_links``)
    _receiver_links: Any = None
    #: how a receiver reaches this scheme's sender (set in the copy a worker is given)
    _connection_info: Any = None
    #: sender side: workers that left the collector (:meth:`forget`)
    _retired: frozenset = frozenset()

    def __init__(self, strategy: str | WeightStrategy = "tensordict", sync: bool = True, timeout: float = 120.0) -> None:
        self._strategy = strategy if isinstance(strategy, WeightStrategy) else WeightStrategy(strategy)
        self.sync = bool(sync)
        self.timeout = float(timeout)
        self._model_id: str | None = None
        self._worker_idx: int | None = None
        self._num_workers: int | None = None
        self._version = 0
        self._reset_roles()

    @classmethod
    def from_backend(cls, backend: str, **kwargs) -> WeightSyncScheme:
        """The scheme that moves weights over ``backend``, built with ``kwargs``.

        Args:
            backend: ``"none"``, ``"shared"``, ``"process"``, ``"distributed"``, ``"rpc"`` or ``"ray"`` (also
                ``"direct"``, ``"thread"`` and ``"multiprocessing"``, aliases of the first three).
            **kwargs: the scheme's constructor arguments.

        Raises:
            ValueError: for another backend name.

        Example:
            >>> WeightSyncScheme.from_backend("shared")
            SharedMemWeightSyncScheme(model_id=None, role=idle, version=0)
        """
        return scheme_class(backend)(**kwargs)

    @classmethod
    def class_for(cls, backend: str) -> type[WeightSyncScheme]:
        """The scheme class of ``backend`` (a ``from_backend`` name; the table is ``backends.py``).

        Raises:
            ValueError: for another backend name.
        """
        return scheme_class(backend)

    def _reset_roles(self) -> None:
        self._context_ref = None
        self._model_ref = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self.initialized_on_sender = False
        self.initialized_on_receiver = False
        self.synchronized_on_sender = False
        self.synchronized_on_receiver = False

    # ------------------------------------------------------------------ properties
    @property
    def model_id(self) -> str | None:
        return self._model_id

    @property
    def context(self):
        """The collector this scheme serves (weakly held), or None."""
        return self._context_ref() if self._context_ref is not None else None

    @property
    def model(self):
        """The model whose weights move: the one given, else resolved on the context by model_id."""
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            return model
        context = self.context
        if context is None or self._model_id is None:
            return None
        try:
            return context.get_model(self._model_id)
        except (AttributeError, KeyError, IndexError):
            # e.g. "env.transform[0].module" on a collector whose envs live in its workers: there is
            # no copy here, so updates must carry their weights (update_policy_weights_(weights_dict=...))
            return None

    @model.setter
    def model(self, value) -> None:
        self._model_ref = _weak(value)

    @property
    def weights(self) -> TensorDictBase | None:
        model = self.model
        return weights_of(model) if model is not None else None

    @property
    def worker_idx(self) -> int | None:
        return self._worker_idx

    @worker_idx.setter
    def worker_idx(self, value: int | None) -> None:
        if self.initialized_on_sender:
            raise RuntimeError("worker_idx cannot be set on a sender scheme.")
        self._worker_idx = value

    @property
    def strategy(self) -> WeightStrategy:
        return self._strategy

    @property
    def strategy_str(self) -> str:
        return self._strategy.extract_as

    @property
    def version(self) -> int:
        """Version of the last weights sent (sender) or applied (receiver)."""
        return self._version

    @property
    def sender_transports(self) -> WeightSender | None:
        return self._sender

    @property
    def receiver_transport(self) -> WeightReceiver | None:
        return self._receiver

    @property
    def shared_transport(self):
        return getattr(self._sender, "shared", None)

    def receiver_wait_handle(self) -> Any | None:
        """What ``multiprocessing.connection.wait`` wakes on when this receiver gets an update, or None."""
        return self._receiver.wait_handle() if self._receiver is not None else None

    def bind_context(self, context: ReceiverContext) -> None:
        """Serve ``context`` from now on (a receiver connected before its collector existed)."""
        self._context_ref = _weak(context)

    # ------------------------------------------------------------------ transport hooks (subclasses)
    def _make_sender(self, links: WeightLinks | None, **kwargs) -> WeightSender | None:
        """Build the sender transport over ``links`` (None without a collector context); ``kwargs``
        are ``init_on_sender``'s extras."""
        return None

    def _make_receiver(self, links: Any = None) -> WeightReceiver | None:
        """Build this worker's receiver transport from the pickled connection info, over ``links``
        (what the worker's transport offers receivers, e.g. a node's process group; or None)."""
        return None

    def use_receiver_links(self, links: Any) -> None:
        """Receiver side, before ``init_on_receiver``: what the transport of the worker this receiver
        runs in offers it (``WorkerEndpoint.receiver_links()``; set by the worker loop)."""
        self._receiver_links = links

    # ------------------------------------------------------------------ life cycle
    def init_on_sender(self, *, model_id: str = "policy", context=None, model=None, num_workers: int | None = None,
                       **kwargs) -> None:
        """Prepare the sender side. A scheme already initialised (e.g. by the user) is left as is,
        except that it learns the collector it serves if it had none (its policy is then where
        ``update_policy_weights_()`` reads the weights)."""
        if self.initialized_on_sender:
            if self._context_ref is None and context is not None:
                self._context_ref = _weak(context)
            return
        try:
            self._model_id = model_id
            self._context_ref = _weak(context)
            if model is not None:
                self.model = model
            links = context.weight_links() if context is not None and self.needs_workers else None
            if num_workers is None and links is not None:
                num_workers = links.num_workers
            self._num_workers = num_workers
            self._sender = self._make_sender(links, **kwargs)
            self.initialized_on_sender = True
        except BaseException:
            self.initialized_on_sender = False
            self._sender = None
            raise

    def init_on_receiver(self, *, model_id: str, context=None, worker_idx: int | None = None, model=None,
                         **kwargs) -> None:
        """Prepare the receiver side inside a worker (``context`` = the worker's collector)."""
        if self.initialized_on_sender:
            # The same object used as sender: return to the state a pickled copy would have.
            self.__setstate__(self.__getstate__())
        self._model_id = model_id
        self._context_ref = _weak(context)
        if model is not None:
            self.model = model
        if worker_idx is None and context is not None:
            worker_idx = context.worker_idx
        self._worker_idx = worker_idx
        self._receiver = self._make_receiver(self._receiver_links, **kwargs)
        self.initialized_on_receiver = True

    def connect(self, *, worker_idx: int | None = None, weights: Any = None) -> None:
        """One-time rendezvous: the sender delivers initial weights, the receiver attaches them.

        Raises:
            RuntimeError: when not initialised, called twice, or given the other role's argument.
        """
        if self.initialized_on_sender:
            if worker_idx is not None:
                raise RuntimeError("connect() on a sender takes no worker_idx.")
            if self.synchronized_on_sender:
                raise RuntimeError("This scheme is already connected (sender).")
            if self._sender is not None:
                initial = self._initial_payload(weights)
                self._sender.connect(initial)
            self.synchronized_on_sender = True
            return
        if self.initialized_on_receiver:
            if weights is not None:
                raise RuntimeError("connect() on a receiver takes no weights.")
            if self.synchronized_on_receiver:
                raise RuntimeError("This scheme is already connected (receiver).")
            if worker_idx is not None:
                self._worker_idx = worker_idx
            if self._receiver is not None:
                initial = self._receiver.connect(self.timeout)
                if initial is not None:
                    self.apply_initial(initial)
                if self._receiver.zero_copy:
                    self._receiver.take_early(self._take_early)
            self.synchronized_on_receiver = True
            return
        raise RuntimeError("connect() needs init_on_sender() or init_on_receiver() first.")

    synchronize_weights = connect

    def _initial_payload(self, weights: Any):
        if weights is not None:
            return self.prepare_weights(weights, self._model_id, self._strategy, self.context)
        model = self.model
        return weights_of(model) if model is not None else None

    def apply_initial(self, weights: TensorDictBase) -> None:
        """Receiver side: run on the weights a worker starts with, and pass them on to its own
        workers (initial weights are not an update: no version moves)."""
        model = self.model
        context = self.context
        if isinstance(model, torch.nn.Module) and self._receiver is not None and self._receiver.zero_copy:
            self._strategy.apply_weights(model, weights, inplace=False)  # also materialises meta models
        elif isinstance(model, torch.nn.Module):
            materialize(model, weights, context.policy_device if context is not None else None)
        elif model is not None:
            self._strategy.apply_weights(model, weights)
        if context is not None:
            context.forward_initial_weights(self._model_id, weights)

    # ------------------------------------------------------------------ sending
    def _check_connected_sender(self) -> None:
        """Raises: RuntimeError unless this scheme is a sender and connected."""
        if not self.initialized_on_sender:
            raise RuntimeError("send() needs init_on_sender() first.")
        if not self.synchronized_on_sender:
            raise RuntimeError("send() needs connect() first.")

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None, *,
             wait: bool | None = None) -> None:
        """Send weights to all (or the listed) workers; waits for acknowledgements when ``wait``
        (default: the scheme's ``sync``), for this send only.

        Raises:
            RuntimeError: when not a connected sender, or when the scheme has no transport.
            ValueError: for an unknown worker index or a per-worker payload this scheme rejects.
        """
        self._check_connected_sender()
        if self._sender is None:
            raise RuntimeError(f"{type(self).__name__} has no transport to send on.")
        payload = self.prepare_weights(weights, self._model_id, self._strategy, self.context)
        targets = self._resolve_worker_ids(worker_ids, payload)
        self._version += 1
        self._sender.deliver(payload, self._version, targets)
        if self.sync if wait is None else wait:
            self._sender.wait_acks(self._version, targets, self.timeout)

    def replace(self, worker_id: int) -> None:
        """Sender side: worker ``worker_id`` is gone; open a channel for the worker replacing it.

        Call it before the replacement's spec is built (a pickled copy of this scheme then carries
        the new channel), and :meth:`attach` once the replacement started.
        """
        self._retired = self._retired - {worker_id}
        if self._sender is not None:
            self._sender.replace(worker_id)

    def forget(self, worker_id: int) -> None:
        """Sender side: worker ``worker_id`` left for good (removed, or preempted without a replacement):
        updates sent to every worker skip it, and naming it in ``worker_ids`` raises. The sender keeps
        its slot, so the other workers' indices do not change (docs/elastic.md)."""
        self._retired = self._retired | {worker_id}
        retire = getattr(self._sender, "retire", None)
        if retire is not None:
            retire(worker_id)

    def attach(self, worker_id: int) -> None:
        """Sender side: connect the receiver of a replacement for ``worker_id`` and deliver the current
        weights to it; the worker runs on them from its first step."""
        if self._sender is not None:
            self._sender.attach(worker_id, self.timeout)

    def _resolve_worker_ids(self, worker_ids, payload) -> list[int]:
        count = self._sender.num_workers if self._sender is not None else (self._num_workers or 0)
        return resolve_worker_ids(worker_ids, payload, count, self._retired, type(self).__name__)

    def prepare_weights(self, weights: Any, model_id: str | None, strategy: WeightStrategy, context=None):
        """Turn any accepted weights form (docs/weights.md, "What update_policy_weights_ accepts") into
        the payload: a TensorDict, or ``{worker_idx: TensorDict}`` for per-worker weights."""
        return payload_of(weights, self.model, model_id, context, self.supports_per_worker_weights,
                          type(self).__name__)

    # ------------------------------------------------------------------ receiving
    def has_pending(self) -> bool:
        """Cheap check (every step in a worker): is an update waiting?"""
        return self._receiver is not None and self._receiver.pending()

    def receive(self, timeout: float | None = None) -> TensorDictBase | None:
        """Take an update if one is waiting: apply it, cascade it, acknowledge it.

        Returns:
            The applied weights, or None when nothing arrived within ``timeout`` (0 = do not wait).
        """
        if not self.initialized_on_receiver:
            raise RuntimeError("receive() needs init_on_receiver() first.")
        if not self.synchronized_on_receiver:
            raise RuntimeError("receive() needs connect() first.")
        receiver = self._receiver
        if receiver is None:
            return None
        with receiver.taking if receiver.taking is not None else contextlib.nullcontext():
            got = receiver.receive(0.0 if timeout is None else timeout)
            if got is None:
                return None
            version, weights = got
            try:
                # Zero-copy transports hand over a buffer reserved for this update: swap it in.
                self.apply_weights(weights, inplace=not receiver.zero_copy)
                self._version = version
                self._cascade(weights)
            except BaseException as err:
                receiver.nack(RemoteFailure.capture(err, self._worker_idx))
                raise
            receiver.ack(version)
            return weights

    def _take_early(self, version: int, load) -> bool:
        """The receiver's thread has an update that needs no waiting (``load()`` maps it): swap it in
        now, under the policy's lock, and acknowledge, when the collector allows it
        (``ReceiverContext.swaps_between_steps``: its policy runs under that lock, an env step's
        action and the version it records together, and taking the update only moves the version).
        The policy then runs on the new weights from its next action on, and every action after the
        acknowledgement (so after ``send`` returned, when it waits) uses them. False: the worker
        loop takes it between two env steps, as any other update."""
        context, model = self.context, self.model
        allows = getattr(context, "swaps_between_steps", None)
        if allows is None or not isinstance(model, torch.nn.Module) or not allows(self._model_id, model):
            return False
        lock = context.policy_lock
        # Only a free lock: the loop holds it through each action and retakes it microseconds after, before
        # this woken thread could (waiting took 2-6 ms on 2 cores); the loop takes the update at its step's end.
        if not lock.acquire(blocking=False):
            return False
        try:
            weights = load()
            self._strategy.apply_weights(model, weights, inplace=False)  # between two actions: never half-swapped
            self._version = version
            self._cascade(weights)  # the version the actions record moves with the weights
        finally:
            lock.release()
        self._receiver.ack(version)
        return True

    def _cascade(self, weights: TensorDictBase) -> None:
        context = self.context
        if context is None:
            return
        context.weights_received(self._model_id, weights, self.model)

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Write ``weights`` into this receiver's model.

        Raises:
            RuntimeError: on a sender, or before ``init_on_receiver``.
            ValueError: when there is no model.
        """
        if self.initialized_on_sender:
            raise RuntimeError("apply_weights() is a receiver operation.")
        if not self.initialized_on_receiver:
            raise RuntimeError("apply_weights() needs init_on_receiver() first.")
        model = self.model
        if model is None:
            raise ValueError(f"No model to apply weights to (model_id={self._model_id!r}).")
        context = self.context
        lock = context.policy_lock if context is not None else None
        with lock if lock is not None else contextlib.nullcontext():  # between two actions
            self._strategy.apply_weights(model, weights, inplace=inplace)

    # ------------------------------------------------------------------ teardown and pickling
    def shutdown(self) -> None:
        """Release the transport (idempotent)."""
        for end in (self._sender, self._receiver):
            if end is not None:
                end.close()
        self._sender = self._receiver = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.shutdown()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in _PICKLE_DROPPED}
        if self._sender is not None:
            state["_connection_info"] = self._sender.connection_info()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_roles()

    def __repr__(self) -> str:
        role = "sender" if self.initialized_on_sender else "receiver" if self.initialized_on_receiver else "idle"
        return f"{type(self).__name__}(model_id={self._model_id!r}, role={role}, version={self._version})"


class NoWeightSyncScheme(WeightSyncScheme):
    """No transport: ``connect`` only sets its flag, ``send`` does nothing, ``receive`` returns None."""

    def send(self, weights: Any = None, worker_ids=None, *, wait: bool | None = None) -> None:
        self._check_connected_sender()
