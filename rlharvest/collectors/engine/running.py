"""Collecting in the background into the replay buffer (``start()``/``pause()``/``async_shutdown()``),
for every engine: a thread of this process iterating (:data:`IN_A_THREAD`), workers writing an rlharvest
buffer themselves (:data:`WORKERS_WRITE`), or workers pushing every batch to a thread here that writes it
(:data:`PUSHED_TO_A_RECEIVER`); a collector's options say which (docs/collection.md, "Running free").
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Protocol

from ...errors import WorkerError
from ...protocol import Command
from .fleet import Fleet
from .loops import BatchLoop
from .pushed import PushedBatchReceiver, Receiving
from .state import Lifecycle

__all__ = ["Background", "LocalRun", "FreeRun", "IN_A_THREAD", "WORKERS_WRITE", "PUSHED_TO_A_RECEIVER", "ThreadRun",
           "WorkersRun", "PushedRun"]


class ThreadRun:
    """A daemon thread that runs an iterator into the replay buffer until stopped.

    While it runs, the thread is the only user of the collector's workers: ``pause()``,
    ``update_policy_weights_`` and the shutdown are what the caller may do meanwhile.

    Args:
        batches: makes the iterator the thread runs (one batch written per step).
        interrupt: makes a batch in progress end soon (workers' rollouts are interrupted).
        name: the thread's name.
    """

    def __init__(self, batches: Callable[[], Iterator[Any]], interrupt: Callable[[], None] = lambda: None,
                 name: str = "rlharvest-run") -> None:
        self._batches = batches
        self._interrupt = interrupt
        self._name = name
        self.thread: threading.Thread | None = None
        self.stop_event: threading.Event | None = None
        self.error: BaseException | None = None
        self._pause_request = threading.Event()
        self._paused = threading.Event()

    def start(self) -> None:
        self.stop_event = threading.Event()
        self._pause_request.clear()
        self._paused.clear()
        self.error = None
        self.thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self.thread.start()

    def is_running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def should_stop(self) -> bool:
        """Checked between env steps of an in-process rollout: the thread was asked to stop."""
        return self.stop_event is not None and self.stop_event.is_set()

    def _run(self) -> None:
        try:
            for _ in self._batches():
                if self.stop_event.is_set():
                    break
                if self._pause_request.is_set():
                    self._paused.set()  # the batch just written was the last one before the pause
                    while self._pause_request.is_set() and not self.stop_event.wait(0.01):
                        pass
                    self._paused.clear()
        except BaseException as err:  # surfaced by pause() / async_shutdown
            self.error = err
        finally:
            self._paused.set()

    @contextlib.contextmanager
    def pause(self, timeout: float = 60.0) -> Iterator[None]:
        """No buffer write inside the block.

        Raises:
            RuntimeError: when not running. TimeoutError: when the thread did not pause in time.
        """
        if not self.is_running():
            raise RuntimeError("Collector cannot be paused: it is not collecting in the background (start()).")
        self._pause_request.set()
        try:
            if not self._paused.wait(timeout):
                raise TimeoutError(f"background collection did not pause within {timeout:g} s.")
            if self.error is not None:
                raise self.error
            yield
        finally:
            self._pause_request.clear()

    @contextlib.contextmanager
    def at_batch_boundary(self) -> Iterator[None]:
        """A block in which no batch is being collected or written (a checkpoint holds one moment)."""
        if not self.is_running():
            yield
            return
        with self.pause():
            yield

    def stop(self, timeout: float | None) -> None:
        """Stop the thread (waiting at most ``timeout`` seconds, default 30).

        Raises:
            TimeoutError: when it did not stop in time.
        """
        if self.stop_event is not None:
            self.stop_event.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            if thread.is_alive():
                self._interrupt()
            thread.join(timeout if timeout is not None else 30.0)
            if thread.is_alive():
                raise TimeoutError(f"Background collection did not stop within {timeout} s.")
        self.thread = None


class WorkersRun:
    """Workers write an rlharvest :class:`~rlharvest.data.ReplayBuffer` themselves (its storage is in
    shared memory); this process only starts, pauses and stops them.

    Args:
        fleet: the workers (their requests are read at each call: workers may be replaced).
        noun: how errors name a worker.
    """

    def __init__(self, fleet: Fleet, noun: str = "worker") -> None:
        self.fleet = fleet
        self.noun = noun

    def start(self) -> None:
        self.fleet.requests.broadcast(Command.RUN_FREE)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Every worker stops after its write in progress; they resume after the block.

        Raises:
            ValueError: when a worker answers something else than ``"paused"``.
        """
        pool = self.fleet.requests
        for worker in pool.active():
            pool.handles[worker].interrupt()
        for worker, reply in zip(pool.active(), pool.broadcast(Command.PAUSE, timeout=30.0)):
            if reply != "paused":
                raise ValueError(f"{self.noun} {worker} answered {reply!r} to pause.")
        try:
            yield
        finally:
            pool.broadcast(Command.RESUME, timeout=30.0)

    def stop(self, timeout: float | None) -> None:
        """Nothing runs here: the workers stop with the fleet."""


class PushedRun:
    """Workers push every batch; a receiver thread here writes them into the replay buffer.

    Args:
        receiver: the thread (``engine/pushed.py``), made when running starts.
        receiving: set while the receiver owns the workers (weight updates take its lock).
    """

    def __init__(self, receiver: PushedBatchReceiver, receiving: Receiving) -> None:
        self.receiver = receiver
        self.receiving = receiving

    def start(self) -> None:
        self.receiving.active = True
        self.receiver.start()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Raises: the receiver's error, or TimeoutError when the workers did not pause in 60 s."""
        receiver = self.receiver
        receiver.pause_requested.set()
        if not receiver.paused.wait(60.0) or receiver.error is not None:
            raise receiver.error or TimeoutError("the workers did not pause within 60 s.")
        try:
            yield
        finally:
            receiver.resume_requested.set()

    def stop(self, timeout: float | None) -> None:
        """Stop the workers pushing (what they pushed meanwhile is written) and the receiver.

        Raises:
            the receiver's error, if it failed.
        """
        receiver = self.receiver
        self.receiving.active = False  # the caller's thread owns the workers again
        receiver.stop_requested.set()
        receiver.resume_requested.set()
        receiver.join(timeout if timeout is not None else 60.0)
        if receiver.error is not None:
            raise receiver.error


class FreeRun(Protocol):
    """How a collector runs free (``start()``), as its options hand it to the engine."""

    def begin(self, background: Background) -> WorkersRun | PushedRun | None:
        """Start running free; returns what runs in the workers (None: a thread here iterates)."""


class _InAThread:
    """A thread here iterates the collector into the replay buffer."""

    def begin(self, background: Background) -> None:
        background.thread_run.start()


class _WorkersWrite:
    """The workers write an rlharvest replay buffer themselves (in shared memory)."""

    def begin(self, background: Background) -> WorkersRun:
        background.loop.prepare_workers_writing()
        run = WorkersRun(background.fleet, background.noun)
        run.start()
        return run


class _PushedToAReceiver:
    """The workers push every batch; a thread here writes them."""

    def begin(self, background: Background) -> PushedRun:
        loop, fleet = background.loop, background.fleet
        loop.drain()
        fleet.requests.broadcast(Command.RUN_FREE)
        run = PushedRun(PushedBatchReceiver(fleet, loop.write_pushed, background.replace_free_worker),
                        background.receiving)
        run.start()
        return run


IN_A_THREAD: FreeRun = _InAThread()
WORKERS_WRITE: FreeRun = _WorkersWrite()
PUSHED_TO_A_RECEIVER: FreeRun = _PushedToAReceiver()


class Background:
    """How one engine collects in the background (``start()``/``pause()``/``async_shutdown()``).

    Args:
        mode: how the collector runs free (None: it cannot).
        loop: the collector's batches (a first batch allocates a buffer workers write; pushed batches
            are written through it).
        fleet: the workers.
        receiving: who replaces a failed worker while workers push to a receiver here.
        replay_buffer: where running free writes (None: ``start()`` is refused).
        iterate: makes the collector's iterator, which a thread here runs into the buffer.
        life: the collector's name and whether it is open.
        noun: how errors name a worker.
    """

    def __init__(self, mode: FreeRun | None, loop: BatchLoop, fleet: Fleet, receiving: Receiving,
                 replay_buffer: Any, iterate: Callable[[], Iterator[Any]], life: Lifecycle,
                 noun: str = "worker") -> None:
        self.mode = mode
        self.loop = loop
        self.fleet = fleet
        self.receiving = receiving
        self.replay_buffer = replay_buffer
        self.life = life
        self.noun = noun
        self.thread_run = ThreadRun(iterate, fleet.interrupt, name=f"{life.name}-run")
        self.free_run: WorkersRun | PushedRun | None = None

    def is_running(self) -> bool:
        return self.free_run is not None or self.thread_run.is_running()

    def workers_run_free(self) -> bool:
        """Whether the workers themselves run free (not a thread here iterating)."""
        return self.free_run is not None

    def start(self) -> None:
        """``start()``: collect in the background into the replay buffer until ``async_shutdown()``.

        Raises:
            NotImplementedError: for a collector that cannot run free. RuntimeError: without a replay
                buffer, or when already running.
        """
        if self.mode is None:
            raise NotImplementedError(f"Collector start() is not implemented for {self.life.name}.")
        if self.replay_buffer is None:
            raise RuntimeError("start() requires a replay_buffer to write the collected data into.")
        if self.is_running():
            raise RuntimeError("The collector is already running.")
        self.life.started = True
        self.free_run = self.mode.begin(self)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Raises: NotImplementedError for a collector that cannot run free; RuntimeError when not running."""
        if self.mode is None:
            raise NotImplementedError(f"Collector pause() is not implemented for {self.life.name}.")
        if self.thread_run.is_running():
            with self.thread_run.pause():
                yield
            return
        if self.free_run is not None:
            with self.free_run.pause():
                yield
            return
        raise RuntimeError("Collector cannot be paused.")

    def stop(self, timeout: float | None) -> None:
        """Stop what runs in the background (idempotent)."""
        run, self.free_run = self.free_run, None
        try:
            if run is not None:
                run.stop(timeout)
        finally:
            self.thread_run.stop(timeout)

    def replace_free_worker(self, err: WorkerError) -> None:
        """Running free: replace the worker ``err`` names (as the restart policy allows, else raise),
        and set its replacement running free too. Called by the receiver thread."""
        with self.receiving.lock:
            while True:
                worker = self.fleet.recover(err)
                try:
                    self.fleet.requests.request(worker, Command.RUN_FREE)
                    return
                except WorkerError as again:  # the replacement failed at once: one more failure
                    err = again


class LocalRun:
    """A ``Collector``'s background collection (``start()``): a thread of this process iterating into the
    replay buffer until ``async_shutdown()``; it cannot pause, as TorchRL's ``Collector``.

    Args:
        thread_run: the thread.
        replay_buffer: where the thread writes (None: ``start()`` is refused).
        life: the collector's name, and whether it started iterating.
    """

    def __init__(self, thread_run: ThreadRun, replay_buffer: Any, life: Lifecycle) -> None:
        self.thread_run = thread_run
        self.replay_buffer = replay_buffer
        self.life = life

    def is_running(self) -> bool:
        return self.thread_run.is_running()

    def start(self) -> None:
        """Raises: RuntimeError without a replay buffer or when already running."""
        if self.replay_buffer is None:
            raise RuntimeError("start() requires a replay_buffer to write the collected data into.")
        if self.is_running():
            raise RuntimeError("The collector is already running.")
        self.life.started = True
        self.thread_run.start()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Raises: NotImplementedError, as TorchRL's ``Collector`` (its background thread stops with
        ``async_shutdown()``)."""
        raise NotImplementedError(f"Collector pause() is not implemented for {self.life.name}.")
        yield  # pragma: no cover

    def stop(self, timeout: float | None) -> None:
        self.thread_run.stop(timeout)
