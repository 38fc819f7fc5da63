"""Collecting in the background into the replay buffer (``start()``/``pause()``/``async_shutdown()``),
for every engine: a thread of this process iterating, workers writing an rlharvest buffer themselves,
or workers pushing every batch to a thread here that writes it (docs/collection.md, "Running free").
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from ...errors import WorkerError
from ...protocol import Command
from .pushed import PushedBatchReceiver

__all__ = ["Background", "ThreadRun", "WorkersRun", "PushedRun"]


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
        requests: makes the fleet's requests (read at each call: workers may be replaced).
    """

    def __init__(self, requests: Callable[[], Any]) -> None:
        self._requests = requests
        self.running = False

    def start(self) -> None:
        self._requests().broadcast(Command.RUN_FREE)
        self.running = True

    @contextlib.contextmanager
    def pause(self, noun: str) -> Iterator[None]:
        """Every worker stops after its write in progress; they resume after the block.

        Raises:
            ValueError: when a worker answers something else than ``"paused"``.
        """
        pool = self._requests()
        for worker in pool.active():
            pool.handles[worker].interrupt()
        for worker, reply in zip(pool.active(), pool.broadcast(Command.PAUSE, timeout=30.0)):
            if reply != "paused":
                raise ValueError(f"{noun} {worker} answered {reply!r} to pause.")
        try:
            yield
        finally:
            pool.broadcast(Command.RESUME, timeout=30.0)


class PushedRun:
    """Workers push every batch; a receiver thread here writes them into the replay buffer.

    Args:
        receiver: the thread (``engine/pushed.py``), made when running starts.
    """

    def __init__(self, receiver: Any) -> None:
        self.receiver = receiver
        #: held while a worker is replaced by the receiver or weights are sent from the caller's thread
        self.lock = threading.RLock()

    def start(self) -> None:
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
        receiver.stop_requested.set()
        receiver.resume_requested.set()
        receiver.join(timeout if timeout is not None else 60.0)
        if receiver.error is not None:
            raise receiver.error


class Background:
    """How one engine collects in the background (``start()``/``pause()``/``async_shutdown()``), as
    its traits say: a thread here, workers writing the buffer, or workers pushing to a receiver here.

    Args:
        engine: the engine (its traits, options, loop and requests).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.thread_run = ThreadRun(lambda: engine.iterate(), engine.interrupt_workers, name=f"{engine.name}-run")
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
        mode = self.engine.traits.run_free
        if mode is None:
            raise NotImplementedError(f"Collector start() is not implemented for {self.engine.name}.")
        if self.engine.config.replay_buffer is None:
            raise RuntimeError("start() requires a replay_buffer to write the collected data into.")
        if self.is_running():
            raise RuntimeError("The collector is already running.")
        self.engine.iteration_started = True
        if mode == "workers" and self.engine.options.workers_write_buffer:
            self.engine.loop.prepare_workers_writing()
            self.free_run = WorkersRun(lambda: self.engine.requests)
            self.free_run.start()
        elif mode == "pushed":
            self.engine.loop.drain()
            self.engine.requests.broadcast(Command.RUN_FREE)
            self.free_run = PushedRun(PushedBatchReceiver(self.engine))
            self.free_run.start()
        else:
            self.thread_run.start()

    @contextlib.contextmanager
    def pause(self):
        """Raises: NotImplementedError for a collector that cannot run free; RuntimeError when not running."""
        if self.engine.traits.run_free is None:
            raise NotImplementedError(f"Collector pause() is not implemented for {self.engine.name}.")
        if self.thread_run.is_running():
            with self.thread_run.pause():
                yield
            return
        if isinstance(self.free_run, WorkersRun):
            with self.free_run.pause(self.engine.traits.noun):
                yield
            return
        if isinstance(self.free_run, PushedRun):
            with self.free_run.pause():
                yield
            return
        raise RuntimeError("Collector cannot be paused.")

    def stop(self, timeout: float | None) -> None:
        """Stop what runs in the background (idempotent)."""
        run, self.free_run = self.free_run, None
        try:
            if isinstance(run, PushedRun):
                run.stop(timeout)
        finally:
            self.thread_run.stop(timeout)

    def replace_free_worker(self, err: WorkerError) -> None:
        """Running free: replace the worker ``err`` names (as the restart policy allows, else raise),
        and set its replacement running free too. Called by the receiver thread."""
        with self.free_run.lock:
            while True:
                worker = self.engine.fleet.recover(err)
                try:
                    self.engine.requests.request(worker, Command.RUN_FREE)
                    return
                except WorkerError as again:  # the replacement failed at once: one more failure
                    err = again

    def write_pushed(self, worker: int, reply) -> None:
        """A batch a worker pushed while running free: into the replay buffer (dropped while stopping
        a collector whose iteration runs the workers free: nobody will take it)."""
        if self.engine.loop.pushing:
            self.engine.requests.handles[worker].fetch_batch(reply)
            return
        batch = self.engine.ids.remap(self.engine.loop.fetch(worker, reply), worker)
        self.engine.loop.write(batch)
        self.engine.frames += reply.frames
