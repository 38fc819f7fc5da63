"""Weights to Ray actors (the transport of RayWeightSyncScheme).

Every update is copied once by the sender, so the learner's tensors are never shared, and each
targeted actor acknowledges the version once it applied it between two env steps (the actor call
that delivered the update returns it then). Where the copy goes depends on the actor's Ray node:

* an actor on the driver's node gets a generation of a named shared-memory pool (``weight_pool``):
  the sender copies the update into a generation no actor runs on, whatever the number of local
  actors, and each actor swaps its model's tensors for views of it (no copy on its side);
* an actor on another node gets a reference to one ``ray.put`` of the update (dense weights as raw
  bytes, one buffer per tensor, with their layout; anything else pickled), which it fetches and
  copies in.

Initial weights go through the object store (one ``ray.put``, before any actor exists). A
replacement actor gets the weights of the last update (or of the start) as its initial weights,
the same way: a generation on the driver's node, a reference elsewhere.

Notices and acknowledgements: for actors on the driver's node, a direct channel (``ray_channel``: a
Unix socket and a shared version board, opened while the actor is built), which spares the two
Ray actor calls per update; for the others, one actor call that returns once the update is applied.
"""

from __future__ import annotations

import multiprocessing.connection
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ..data.flat import flat_leaves, is_dense
from ..errors import RemoteFailure, WorkerError, WorkerTimeoutError
from .base import WeightLinks, WeightReceiver, WeightSender
from .pipes import Doorbell
from .ray_channel import ChannelClient, ChannelServer, Wakeup, channel_supported
from .weight_pool import Generation, GenerationBook, NamedShmAllocator, attach_named

__all__ = ["RayWeightLinks", "RayWeightSender", "RayWeightReceiver", "WeightInboxes", "stage_weights",
           "unstage_weights"]


@dataclass
class RayWeightLinks(WeightLinks):
    """What Ray weight senders need: the actors' handles, by index (updated in place on a replacement)."""

    handles: list = field(default_factory=list)


def stage_weights(weights: TensorDictBase):
    """Put ``weights`` in the object store (one copy); returns the reference."""
    import ray

    if not is_dense(weights):
        return ray.put(("pickled", weights))
    keys, leaves = flat_leaves(weights)
    layout = [(key, leaf.dtype, tuple(leaf.shape)) for key, leaf in zip(keys, leaves)]
    buffers = [leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for leaf in leaves]
    return ray.put(("flat", tuple(weights.batch_size), layout, buffers))


def unstage_weights(staged: tuple) -> TensorDictBase:
    """The weights of a staged object, as read from the object store (read-only views when dense)."""
    if staged[0] == "pickled":
        return staged[1]
    _, batch_size, layout, buffers = staged
    weights = TensorDict({}, batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the store's buffers are read-only: they are only read (copied in)
        for (key, dtype, shape), buffer in zip(layout, buffers):
            weights.set(key, torch.from_numpy(buffer).view(dtype).view(shape))
    return weights


# ---------------------------------------------------------------------------------------------- actor side
class _Inbox:
    """One model's weights waiting in an actor: the initial ones, the latest update, its acknowledgement."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.initial: tuple | None = None
        self.update: tuple | None = None
        self.acked = 0
        self.failure: RemoteFailure | None = None
        self.doorbell = Doorbell()


class WeightInboxes:
    """Per model, what the parent delivered to this actor, for its receivers (the actor's receiver links)."""

    def __init__(self) -> None:
        self._inboxes: dict[str, _Inbox] = {}
        self._lock = threading.Lock()

    def get(self, model_id: str) -> _Inbox:
        with self._lock:
            return self._inboxes.setdefault(model_id, _Inbox())

    def deliver(self, model_id: str, version: int, payload: list, initial: bool, timeout: float):
        """Leave ``payload`` for the receiver; for an update, wait until it acknowledged ``version``.

        Returns the version, or the failure that stopped the update (a RemoteFailure).
        """
        inbox = self.get(model_id)
        with inbox.cond:
            if initial:
                inbox.initial = (version, payload)
                inbox.cond.notify_all()
                return version
            inbox.failure = None
            inbox.update = (version, payload)  # the latest wins: acknowledging it covers older ones
            inbox.doorbell.ring()
            inbox.cond.wait_for(lambda: inbox.acked >= version or inbox.failure is not None, timeout)
            if inbox.failure is not None:
                return inbox.failure
            if inbox.acked < version:
                error = WorkerTimeoutError(f"weights version {version} were not applied within {timeout:g} s.")
                return RemoteFailure.capture(error, None)
            return version


class RayWeightReceiver(WeightReceiver):
    """An actor's end: the inbox of its model, filled by the parent's ``deliver_weights`` calls, and,
    on the driver's node, the direct channel (``ray_channel``) updates arrive through.

    ``zero_copy`` says how the payload last returned arrived: a shared-memory generation reserved
    for this update (swapped in) or weights read from the object store (copied in).
    """

    def __init__(self, inbox: _Inbox) -> None:
        self.inbox = inbox
        self.zero_copy = False
        self._segments: dict[int, tuple] = {}
        self._channel: ChannelClient | None = None
        #: the last version taken from the channel, and whether the update last returned came through it
        self._taken = 0
        self._via_channel = False
        self._wakeup = Wakeup(inbox.doorbell)

    def connect(self, timeout: float) -> TensorDictBase | None:
        """The initial weights (None when the parent has none: the policy came with the spec); opens
        the direct channel when the parent invited this actor and it runs on the parent's node."""
        inbox = self.inbox
        with inbox.cond:
            if not inbox.cond.wait_for(lambda: inbox.initial is not None, timeout):
                raise TimeoutError(f"no initial weights arrived within {timeout:g} s.")
            version, payload = inbox.initial
        invite = payload[1] if len(payload) > 1 else None
        if invite is not None and invite["node"] == _own_node_id():
            self._channel = ChannelClient(invite, timeout)
            self._wakeup.add(self._channel.conn)
            self._taken = version
            for gen_id, handle in invite["generations"]:  # mapped and read now, not at the first updates
                self._segments[gen_id] = attach_named(handle)
                for leaf in self._segments[gen_id][1].values(True, True):
                    leaf.sum()
        return self._open(payload)

    def pending(self) -> bool:
        channel = self._channel
        return self.inbox.update is not None or (channel is not None and channel.announced() > self._taken)

    def receive(self, timeout: float) -> tuple[int, TensorDictBase] | None:
        channel = self._channel
        if channel is None:
            return self._receive_inbox(timeout)
        if timeout > 0 and self.inbox.update is None and not channel.conn.poll(0):
            multiprocessing.connection.wait([self._wakeup], timeout)
        if channel.conn.poll(0):
            _, version, body = channel.conn.recv()
            self._taken = version
            self._via_channel = True
            return version, self._open([body])
        return self._receive_inbox(0.0)

    def _receive_inbox(self, timeout: float) -> tuple[int, TensorDictBase] | None:
        inbox = self.inbox
        with inbox.cond:
            if inbox.update is None and timeout > 0:
                inbox.cond.wait_for(lambda: inbox.update is not None, timeout)
            item, inbox.update = inbox.update, None
            inbox.doorbell.clear()
        if item is None:
            return None
        self._via_channel = False
        version, payload = item
        return version, self._open(payload)

    def _open(self, payload: list) -> TensorDictBase | None:
        """The weights ``payload`` (``[body, ...]``, see :class:`RayWeightSender`) stands for."""
        body = payload[0] if payload else None
        if body is None:
            return None
        if body[0] == "shm":
            _, gen_id, handle = body
            if handle is not None:  # a generation this actor has not mapped yet
                self._segments[gen_id] = attach_named(handle)
            self.zero_copy = True
            return self._segments[gen_id][1]
        import ray

        self.zero_copy = False
        return unstage_weights(ray.get(body[1]))

    def ack(self, version: int) -> None:
        if self._via_channel:
            self._channel.conn.send(("ack", version))
            return
        with self.inbox.cond:
            self.inbox.acked = max(self.inbox.acked, version)
            self.inbox.cond.notify_all()

    def nack(self, failure) -> None:
        if self._via_channel:
            self._channel.conn.send(("error", failure))
            return
        with self.inbox.cond:
            self.inbox.failure = failure
            self.inbox.cond.notify_all()

    def wait_handle(self):
        return self._wakeup

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._wakeup.close()
        for mapping, _ in self._segments.values():
            try:
                mapping.close()
            except (BufferError, OSError):
                pass  # the model may still hold views of it: the OS unmaps it when the actor exits
        self._segments.clear()


def _own_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


# ---------------------------------------------------------------------------------------------- parent side
class RayWeightSender(WeightSender):
    """Each update copied once: into a shared-memory generation for actors on the driver's node, into
    the object store (one ``ray.put``) for actors elsewhere.

    An actor call carries ``[body]`` (in a list, so that Ray hands a reference over unresolved), and
    with initial weights also the invitation to the direct channel: ``[body, invite]``. A body is
    ``None`` (no weights), ``("ref", reference)`` or ``("shm", generation id, handle)``, the handle
    only the first time an actor is sent that generation. Updates of actors on the driver's node
    go through the channel (``ray_channel``) instead of actor calls.

    Args:
        handles: the actors' handles (``actor``, ``is_alive``, ``exit_description``,
            ``wait_node_id``), by index.
        model_id: the model these weights are for.
        use_shared_memory: whether actors on the driver's node get updates through shared memory.
    """

    #: it serves ``len(handles)`` actors, the backend's list grown in place (``RayBackend.grow``)
    growable = True

    def __init__(self, handles: list, model_id: str, use_shared_memory: bool = True) -> None:
        import ray

        self.handles = handles
        self.model_id = model_id
        self.timeout = 120.0
        self._driver_node = ray.get_runtime_context().get_node_id() if use_shared_memory else None
        self._server: ChannelServer | None = None
        #: worker -> (version, Ray reference of the call that returns once it is applied)
        self._acks: dict[int, tuple[int, Any]] = {}
        #: worker -> version announced through the channel and not yet acknowledged
        self._channel_unacked: dict[int, int] = {}
        #: the shared-memory generations of actors on the driver's node (those handed with an actor's
        #: invitation count as mapped)
        self.book = GenerationBook(NamedShmAllocator)
        #: ``(version, staged)`` of the last update or of the initial weights: what a replacement
        #: gets; ``staged`` is an object-store reference (or None) or a Generation
        self._latest: tuple[int, Any] = (0, None)

    @property
    def num_workers(self) -> int:
        return len(self.handles)

    def _send(self, worker: int, version: int, body: Any, initial: bool, generations: list | None = None):
        payload = [body]
        if initial and self._server is not None:
            payload.append({**self._server.invite(worker, self._driver_node), "generations": generations or []})
        return self.handles[worker].actor.deliver_weights.remote(self.model_id, version, payload, initial, self.timeout)

    def _is_local(self, worker: int) -> bool:
        """Whether actor ``worker`` runs on the driver's node (it reads shared memory of this host)."""
        if self._driver_node is None:
            return False
        return self.handles[worker].wait_node_id(self.timeout) == self._driver_node

    def _liveness(self, worker: int) -> tuple[bool, str]:
        handle = self.handles[worker]
        return handle.is_alive(), handle.exit_description()

    def connect(self, initial) -> None:
        """Hand every actor its initial weights (or word that there are none) once, by reference,
        with its invitation to the direct channel: the actors need not exist yet."""
        ref = stage_weights(initial) if initial is not None else None
        self._latest = (0, ref)
        ready = []
        if self._driver_node is not None and channel_supported():
            self._server = ChannelServer(self.num_workers)
            ready = self._ready_generations(initial)
        for worker in range(self.num_workers):
            self._send(worker, 0, None if ref is None else ("ref", ref), initial=True, generations=ready)
            self.book.premap(worker, [gen_id for gen_id, _ in ready])

    def _ready_generations(self, initial) -> list[tuple[int, Any]]:
        """The two generations updates alternate between, allocated and written now (with the
        initial weights), so that the first updates do not pay for creating them: ``[(id, handle)]``,
        handed to the actors with their invitations (they map them while they are built)."""
        if initial is None or not is_dense(initial):
            return []
        generations = []
        for _ in range(2):
            generations.append(self.book.stage(initial, keep=[g.gen_id for g in generations]))
        return [(generation.gen_id, generation.handle) for generation in generations]

    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        if isinstance(payload, dict):
            raise ValueError("RayWeightSyncScheme sends the same weights to every actor (no per-worker payloads).")
        unsettled = [worker for worker in worker_ids if worker in self._acks or worker in self._channel_unacked]
        if unsettled:  # an update sent without waiting (sync=False): its generation may not be swapped in yet
            self.wait_acks(version - 1, unsettled, self.timeout)
        # raw tensors only in shared memory (anything else is pickled into the object store)
        local = [worker for worker in worker_ids if self._is_local(worker)] if is_dense(payload) else []
        remote = [worker for worker in worker_ids if worker not in local]
        if local and self._server is not None:
            deadline = time.monotonic() + self.timeout
            for worker in local:  # opened while the actors were built: waits only for one still building
                self._server.connection(worker, deadline, lambda w=worker: self._liveness(w))
        generation = self._stage_shared(payload) if local else None
        ref = stage_weights(payload) if remote else None
        self._latest = (version, generation if generation is not None else ref)
        for worker in local:
            self._announce(worker, version, self._shm_body(worker, generation))
        for worker in remote:
            self._acks[worker] = (version, self._send(worker, version, ("ref", ref), initial=False))

    def _announce(self, worker: int, version: int, body: tuple) -> None:
        """Tell an actor on the driver's node about a generation: through the channel, or (where
        there is none) through an actor call."""
        if self._server is None:
            self._acks[worker] = (version, self._send(worker, version, body, initial=False))
            return
        try:
            self._server.announce(worker, version, body)
        except OSError as err:  # the actor is gone (its end of the socket closed)
            raise self._died(worker, type(err).__name__) from err
        self._channel_unacked[worker] = version

    def _stage_shared(self, weights: TensorDictBase) -> Generation:
        latest = self._latest[1]  # what a replacement would be handed stays untouched
        return self.book.stage(weights, keep=[latest.gen_id] if isinstance(latest, Generation) else [])

    def _shm_body(self, worker: int, generation: Generation, initial: bool = False) -> tuple:
        return "shm", generation.gen_id, self.book.hand(worker, generation.gen_id, generation.handle, initial)

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._wait_channel_acks(version, [worker for worker in worker_ids if worker in self._channel_unacked],
                                deadline, timeout)
        self._wait_call_acks(version, [worker for worker in worker_ids if worker in self._acks], deadline, timeout)

    def _wait_channel_acks(self, version: int, workers: list[int], deadline: float, timeout: float) -> None:
        """Read the channel acknowledgements of ``workers``: a wait on their sockets, in slices between
        which their liveness is checked (a dead actor's socket closes: the wait ends at once)."""
        waiting = {self._server.conns[worker]: worker for worker in workers}
        while waiting:
            remaining = deadline - time.monotonic()
            for conn in multiprocessing.connection.wait(list(waiting), timeout=min(0.2, max(0.0, remaining))):
                worker = waiting[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError) as err:
                    raise self._died(worker, type(err).__name__) from err
                if message[0] == "error":
                    del self._channel_unacked[worker]
                    self.book.dropped(worker)
                    raise message[1].to_exception(context="applying new weights")
                if message[1] >= self._channel_unacked[worker]:
                    del waiting[conn], self._channel_unacked[worker]
                    self.book.acknowledged(worker)
            for worker in waiting.values():
                if not self.handles[worker].is_alive():
                    raise self._died(worker, "")
            if waiting and remaining <= 0:
                raise WorkerTimeoutError(f"actor(s) {sorted(waiting.values())} did not acknowledge weights version "
                                         f"{version} within {timeout:g} s.", worker_idx=min(waiting.values()))

    def _died(self, worker: int, how: str) -> WorkerError:
        """The error of an actor found dead while it applied an update (its poll says why within moments)."""
        handle = self.handles[worker]
        until = time.monotonic() + 2.0
        while handle.is_alive() and time.monotonic() < until:
            time.sleep(0.02)
        detail = handle.exit_description() if not handle.is_alive() else "its weight channel closed"
        return WorkerError(f"the actor died while applying new weights: {detail}" + (f" ({how})." if how else "."),
                           worker_idx=worker)

    def _wait_call_acks(self, version: int, workers: list[int], deadline: float, timeout: float) -> None:
        import ray

        waiting = {worker: self._acks[worker][1] for worker in workers}
        while waiting:
            ready, _ = ray.wait(list(waiting.values()), num_returns=len(waiting), timeout=0.2)
            for worker, ref in list(waiting.items()):
                if ref in ready:
                    del waiting[worker]
                    self._acks.pop(worker, None)
                    self._check_ack(worker, ref)
                elif not self.handles[worker].is_alive():
                    raise WorkerError(f"the actor died while applying new weights: "
                                      f"{self.handles[worker].exit_description()}.", worker_idx=worker)
            if waiting and time.monotonic() > deadline:
                raise WorkerTimeoutError(f"actor(s) {sorted(waiting)} did not acknowledge weights version {version} "
                                         f"within {timeout:g} s.", worker_idx=min(waiting))

    def _check_ack(self, worker: int, ref: Any) -> None:
        import ray

        try:
            answer = ray.get(ref)
        except Exception as err:
            self.book.dropped(worker)
            handle = self.handles[worker]
            raise WorkerError(f"the actor died while applying new weights: {handle.exit_description()} "
                              f"({type(err).__name__}).", worker_idx=worker) from err
        if isinstance(answer, RemoteFailure):
            self.book.dropped(worker)
            raise answer.to_exception(context="applying new weights")
        self.book.acknowledged(worker)

    def replace(self, worker: int) -> None:
        for state in (self._acks, self._channel_unacked):
            state.pop(worker, None)
        self.book.forget(worker)
        if self._server is not None:
            self._server.drop(worker)

    def retire(self, worker: int) -> None:
        """Actor ``worker`` left for good: its channel closes, nothing of it is awaited any more."""
        self.replace(worker)

    def attach(self, worker: int, timeout: float) -> None:
        """Hand the replacement the weights of the last update (or of the start), as its initial
        weights, with a new invitation to the direct channel."""
        version, staged = self._latest
        if isinstance(staged, Generation):
            if self._is_local(worker):
                # initial weights are not acknowledged: it runs on them
                self._send(worker, version, self._shm_body(worker, staged, initial=True), initial=True)
                return
            staged = stage_weights(staged.view)
        self._send(worker, version, None if staged is None else ("ref", staged), initial=True)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.book.close()
