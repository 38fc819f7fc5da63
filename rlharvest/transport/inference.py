"""Policy calls across the process boundary: env workers ask, one server in the collector's process answers.

Every env worker runs the ordinary rollout loop with an :class:`InferenceClient` as its policy. Per
step the client copies the values the policy reads into its row of shared request buffers and
writes its index (2 bytes) to a request pipe all clients share, then sleeps on its own response
pipe. The :class:`InferenceServer`, a thread of the collector's process, drains that pipe: whichever
workers are ready (no barrier), up to ``max_batch_size`` frames, are answered by one policy call on
their stacked rows; it writes the outputs and the version of the weights that produced them into
the workers' rows of the response buffers and one byte to each response pipe. Nothing is pickled
per step; pickled messages only travel once per worker, while it is built (the :class:`Hello` that
tells the server the layout of a root, on the worker's control pipe, and the server's answer with
the buffers). The server thread answers those too, so it runs before the workers are built.

The policy changes only in :meth:`InferenceServer.update_policy`, between two policy calls under the
server's lock, so every action carries the exact version of the weights that computed it. The
collector hands the server a private copy of the user's policy, so that an optimizer step in
progress never reaches an env.
"""

from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import set_interaction_type

from .._utils import NestedKey
from ..errors import WorkerTimeoutError
from ..policies import PolicyStep, TensorModuleStep, make_policy_step, wrap_policy

__all__ = ["InferenceChannels", "InferenceClient", "InferenceServer", "Hello", "EnvView", "PolicyServerError"]

_RUNNING, _FAILED, _STOPPED = 0, 1, 2
_OK, _ERROR = b"\x00", b"\x01"


class PolicyServerError(RuntimeError):
    """The policy server could not answer (its policy raised, or it was stopped)."""


@dataclass
class EnvView:
    """What the server needs of a worker's env to wrap the policy (sent once, in the Hello)."""

    batch_size: torch.Size
    observation_keys: list
    action_keys: list

    @property
    def observation_spec(self):
        from ..envs.specs import Composite, Unbounded

        return Composite({key: Unbounded(()) for key in self.observation_keys})


@dataclass
class Hello:
    """A worker's first message: its index, its env, and one root (the layout of its requests)."""

    worker_idx: int
    env: EnvView
    root: dict


@dataclass
class _Ack:
    requests: dict
    responses: dict
    versions: torch.Tensor
    failure: str | None = None


class InferenceChannels:
    """The pipes between the server and ``num_workers`` clients; created before the workers start."""

    def __init__(self, ctx, num_workers: int) -> None:
        self.num_workers = num_workers
        self.request_r, self.request_w = ctx.Pipe(duplex=False)
        self.responses = [ctx.Pipe(duplex=False) for _ in range(num_workers)]
        self.controls = [ctx.Pipe(duplex=True) for _ in range(num_workers)]
        self.state = torch.zeros(1, dtype=torch.int8).share_memory_()

    def client(self, worker_idx: int, policy_version_key: NestedKey | None, timeout: float) -> InferenceClient:
        return InferenceClient(worker_idx, self.request_w, self.responses[worker_idx][0],
                               self.controls[worker_idx][1], self.state, policy_version_key, timeout)

    def close(self) -> None:
        conns = [self.request_r, self.request_w] + [c for pair in self.responses + self.controls for c in pair]
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass
        # A private copy, in place (the clients in the workers' specs hold this very tensor): the shared
        # segment's descriptor closes with the collector's shutdown, even while the collector is referenced.
        self.state.set_(self.state.clone())


class InferenceClient(PolicyStep):
    """The policy of an env worker: asks the server, waits for its answer (bounded, checks liveness).

    Args:
        worker_idx: the worker's row in the buffers.
        request_w, response_r, control: its ends of the channels.
        state: the server's shared state (running / failed / stopped).
        policy_version_key: where to write the version of the weights that produced each action.
        timeout: seconds to wait for an answer before ``WorkerTimeoutError``.
    """

    def __init__(self, worker_idx: int, request_w, response_r, control, state: torch.Tensor,
                 policy_version_key: NestedKey | None, timeout: float) -> None:
        self.worker_idx = worker_idx
        self.request_w, self.response_r, self.control = request_w, response_r, control
        self.state = state
        self.policy_version_key = policy_version_key
        self.timeout = float(timeout)
        self.out_keys: list = []
        self._requests: dict | None = None
        #: the process that started this worker, once connected (a different parent means it died)
        self._parent: int | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_requests": None}

    def connect(self, env, root: dict) -> None:
        """Describe this worker's env and root to the server; take views of its rows of the buffers."""
        view = EnvView(torch.Size(env.batch_size), list(env.observation_spec.keys(True, True)), list(env.action_keys))
        self.control.send(Hello(self.worker_idx, view, {k: _as_tensor(v).clone() for k, v in root.items()}))
        if not self._wait(self.control, "the policy server's answer to this worker's first message"):
            raise PolicyServerError("the policy server stopped before answering this worker.")
        ack: _Ack = self.control.recv()
        if ack.failure is not None:
            raise PolicyServerError(ack.failure)
        index = self.worker_idx
        self._requests = {key: buffer[index] for key, buffer in ack.requests.items()}
        self._responses = {key: buffer[index] for key, buffer in ack.responses.items()}
        self._version = ack.versions[index]
        self._batch_size = torch.Size(env.batch_size)
        self.out_keys = list(self._responses) + ([self.policy_version_key] if self.policy_version_key else [])
        self._me = index.to_bytes(2, "little")
        self._poller = select.poll()
        self._poller.register(self.response_r.fileno(), select.POLLIN)
        self._parent = os.getppid()

    def __call__(self, root: dict) -> dict:
        if self._requests is None:
            raise RuntimeError("InferenceClient.connect() must run before the first step.")
        for key, slot in self._requests.items():
            slot.copy_(_as_tensor(root[key]).reshape(slot.shape))
        os.write(self.request_w.fileno(), self._me)
        if not self._wait(None, "an action from the policy server"):
            raise PolicyServerError("the policy server stopped.")
        if os.read(self.response_r.fileno(), 1) != _OK:
            raise PolicyServerError("the policy server's policy raised (the collector raises the original error).")
        outputs = {key: slot.clone() for key, slot in self._responses.items()}
        if self.policy_version_key is not None:
            outputs[self.policy_version_key] = self._version.expand(self._batch_size).clone()
        return outputs

    def _wait(self, conn, what: str) -> bool:
        """Until the answer is there (True) or the server stopped (False); raises after ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            if conn is not None:
                ready = conn.poll(0.25)
            else:
                ready = bool(self._poller.poll(250))
            if ready:
                return True
            if int(self.state[0]) == _STOPPED or (self._parent is not None and os.getppid() != self._parent):
                return False
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(f"no answer from the policy server within {self.timeout:g} s ({what}).",
                                         worker_idx=self.worker_idx)


def _send(conn, message: Any) -> bool:
    try:
        conn.send(message)
        return True
    except OSError:  # the worker is gone
        return False


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return torch.as_tensor([value])


class _TensorDictCall:
    """A policy called on a TensorDict of any leading batch size; out keys found on the first call."""

    def __init__(self, policy: Callable, action_keys: list, device: torch.device | None = None) -> None:
        self.policy, self.action_keys, self.device = policy, action_keys, device
        self.out_keys: list | None = None

    def __call__(self, values: dict) -> dict:
        batch = next(iter(values.values())).shape[:1]
        td = TensorDict(dict(values), batch_size=batch, device=self.device)
        before = {k: td.get(k) for k in td.keys(True, True)} if self.out_keys is None else None
        result = self.policy(td)
        result = td if result is None else result
        if self.out_keys is None:
            self.out_keys = [k for k in result.keys(True, True) if k not in before or result.get(k) is not before[k]]
            self.out_keys += [k for k in self.action_keys if k not in self.out_keys]
        return {k: result.get(k) for k in self.out_keys}


def _input_keys(step, root_keys: list) -> list:
    """The root keys a policy step reads (all of them, unless its stages say which)."""
    if not isinstance(step, TensorModuleStep):
        return list(root_keys)
    needed, produced = [], set()
    for _, in_keys, out_keys in step.stages:
        needed += [k for k in in_keys if k not in produced and k not in needed]
        produced |= set(out_keys)
    return needed


class InferenceServer:
    """Answers the clients' requests from a thread of this process, batching whoever is ready.

    Args:
        policy: the policy to serve (the server runs it as it is; it changes only through
            :meth:`update_policy`).
        channels: the pipes to the clients.
        max_batch_size: most frames (env observations) one policy call serves.
        min_batch_size: frames to gather, for up to ``timeout`` seconds, before calling the policy.
        timeout: see ``min_batch_size``.
        device: where the policy runs (inputs are moved there, outputs back to the CPU).
        exploration_type: the interaction mode of every policy call.
        trust_policy: passed to the policy wrapping (see ``rlharvest.policies.wrap_policy``).
        version: the version of the initial weights.
    """

    def __init__(self, policy: Callable, channels: InferenceChannels, *, max_batch_size: int, min_batch_size: int,
                 timeout: float, device: torch.device | None, exploration_type: Any, trust_policy: bool | None,
                 version: int = 0) -> None:
        self.channels = channels
        self.num_workers = channels.num_workers
        self.policy = policy
        self.max_batch_size, self.min_batch_size, self.timeout = max_batch_size, min_batch_size, timeout
        self.device, self.exploration_type, self.trust_policy = device, exploration_type, trust_policy
        self.version = int(version)
        self.error: BaseException | None = None
        self.setup_error: BaseException | None = None
        self.stats = {"requests": 0, "batches": 0, "frames": 0, "max_batch_frames": 0}
        self._lock = threading.RLock()
        self._layout: tuple | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False

    # ------------------------------------------------------------------ a worker's first message
    def _greet(self, worker: int) -> bool:
        """Answer worker ``worker``'s Hello (the first one also fixes the layouts); False once its
        control pipe is closed.

        A worker whose env does not fit, or a policy that fails on the first root, gets the failure
        in the answer (its constructor raises it); the exception itself is kept in ``setup_error``.
        """
        control = self.channels.controls[worker][0]
        try:
            hello: Hello = control.recv()
        except (EOFError, OSError):
            return False
        try:
            if self._layout is None:
                self._configure(hello)
            layout = {k: (tuple(v.shape), v.dtype) for k, v in hello.root.items() if k in self._in_layout}
            if layout != self._in_layout or torch.Size(hello.env.batch_size) != self.env_batch:
                raise ValueError(f"worker {hello.worker_idx}'s env does not stack with the first worker's: its policy inputs "
                                 f"{layout} (batch {tuple(hello.env.batch_size)}) against {self._in_layout} "
                                 f"(batch {tuple(self.env_batch)}).")
        except Exception as err:
            self.setup_error = err
            return _send(control, _Ack({}, {}, torch.zeros(0), failure=f"{type(err).__name__}: {err}"))
        return _send(control, _Ack(self.requests, self.responses, self.versions))

    def _configure(self, hello: Hello) -> None:
        env = hello.env
        self.env_batch = torch.Size(env.batch_size)
        self.frames_per_request = int(np.prod(self.env_batch)) if self.env_batch else 1
        wrapped = wrap_policy(self.policy, env, self.trust_policy)
        step = make_policy_step(wrapped, env, set(hello.root), self.device)
        general = _TensorDictCall(wrapped, [k for k in env.action_keys], self.device)
        if isinstance(step, TensorModuleStep):  # its general step for the requests' batch of any size
            general.out_keys, step.general = list(step.out_keys), general
        else:
            step = general
        in_keys = _input_keys(step, list(hello.root))
        missing = [k for k in in_keys if k not in hello.root]
        if missing:
            raise KeyError(f"the policy reads {missing}, which the env's root does not have "
                           f"({sorted(map(str, hello.root))}).")
        self._step = step
        self._in_layout = {k: (tuple(hello.root[k].shape), hello.root[k].dtype) for k in in_keys}
        outputs = self._call({k: self._flat(hello.root[k].unsqueeze(0)) for k in in_keys})  # one pass: the out layout
        for key, value in outputs.items():
            if value.shape[:1] != (self.frames_per_request,):
                raise ValueError(f"the policy's output {key!r} has shape {tuple(value.shape)}: expected one row "
                                 f"per env ({self.frames_per_request}, ...).")
        out_layout = {k: ((*self.env_batch, *v.shape[1:]), v.dtype) for k, v in outputs.items()}
        self.requests = self._shared(self._in_layout)
        self.responses = self._shared(out_layout)
        self.versions = torch.zeros(self.num_workers, dtype=torch.int64).share_memory_()
        self._layout = (self._in_layout, out_layout)

    def _shared(self, layout: dict) -> dict:
        return {key: torch.zeros((self.num_workers, *shape), dtype=dtype).share_memory_()
                for key, (shape, dtype) in layout.items()}

    def _flat(self, value: torch.Tensor) -> torch.Tensor:
        """``(n, *env_batch, *feat)`` -> ``(n * frames_per_request, *feat)``."""
        return value.reshape(-1, *value.shape[1 + len(self.env_batch):])

    def _call(self, inputs: dict) -> dict:
        with self._lock, torch.no_grad(), set_interaction_type(self.exploration_type):
            return self._step(inputs)

    # ------------------------------------------------------------------ serving
    def start(self) -> None:
        """Serve from a thread until :meth:`stop` (start it before the workers are built)."""
        self._thread = threading.Thread(target=self._serve, name="rlharvest-policy-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        request_fd = self.channels.request_r.fileno()
        poller = select.poll()
        poller.register(request_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        self._controls = {}
        for worker, (control, _) in enumerate(self.channels.controls):
            self._controls[control.fileno()] = worker
            poller.register(control.fileno(), select.POLLIN)
        pending: list[int] = []
        while not self._stopping:
            if not pending and not poller.poll(100):
                continue
            pending += self._drain(poller, request_fd, 0)
            if pending and len(pending) * self.frames_per_request < self.min_batch_size:
                deadline = time.monotonic() + self.timeout
                while len(pending) * self.frames_per_request < self.min_batch_size and not self._stopping:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    pending += self._drain(poller, request_fd, remaining)
            if pending and not self._stopping:
                per_call = max(1, self.max_batch_size // self.frames_per_request)
                batch, pending = pending[:per_call], pending[per_call:]
                self._answer(batch)

    def _drain(self, poller, request_fd: int, timeout: float) -> list[int]:
        """Worker indices of the requests that arrived (waiting up to ``timeout`` seconds for one);
        Hellos that arrived meanwhile are answered."""
        ready = []
        for fd, _ in poller.poll(timeout * 1000.0):
            if fd == request_fd:
                data = os.read(request_fd, 2 * self.num_workers)
                ready += np.frombuffer(data[: len(data) // 2 * 2], dtype="<u2").tolist()
            elif fd in self._controls:
                if not self._greet(self._controls[fd]):  # a worker gone while it was built: its start fails
                    poller.unregister(fd)
                    del self._controls[fd]
            else:
                os.read(fd, 64)
        return ready

    def _answer(self, workers: list[int]) -> None:
        """One policy call for the requests of ``workers``; each gets its outputs and an OK byte."""
        code = _OK
        if self.error is None:
            try:
                self._compute(workers)
            except BaseException as err:  # raised by the collector in the caller's thread
                self.error = err
                self.channels.state[0] = _FAILED
        if self.error is not None:
            code = _ERROR
        for worker in workers:
            os.write(self.channels.responses[worker][1].fileno(), code)

    def _compute(self, workers: list[int]) -> None:
        index = torch.tensor(workers, dtype=torch.long)
        inputs = {key: self._flat(buffer.index_select(0, index)) for key, buffer in self.requests.items()}
        with self._lock, torch.no_grad(), set_interaction_type(self.exploration_type):
            outputs = self._step(inputs)
            version = self.version
        count = len(workers)
        for key, buffer in self.responses.items():
            value = outputs[key].reshape(count, *buffer.shape[1:])
            buffer.index_copy_(0, index, value.to(device=buffer.device, dtype=buffer.dtype))
        self.versions.index_fill_(0, index, version)
        stats, frames = self.stats, count * self.frames_per_request
        stats["requests"] += count
        stats["batches"] += 1
        stats["frames"] += frames
        stats["max_batch_frames"] = max(stats["max_batch_frames"], frames)

    # ------------------------------------------------------------------ weights and life cycle
    def policy_state_dict(self) -> dict:
        """A copy of the served policy's ``state_dict()``, taken between two policy calls (a checkpoint's)."""
        with self._lock:
            return {key: value.detach().clone() for key, value in self.policy.state_dict().items()}

    def update_policy(self, change: Callable[[Any], None] | None = None) -> int:
        """Run ``change(policy)`` between two policy calls (e.g. copy new weights in) and bump the
        version of the weights; returns the new version."""
        with self._lock:
            if change is not None:
                change(self.policy)
            self.version += 1
            return self.version

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (clients still waiting get a PolicyServerError); idempotent."""
        self._stopping = True
        self.channels.state[0] = _STOPPED
        if self._wake_w >= 0:
            os.write(self._wake_w, b"\x00")
        if self._thread is not None:
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if not self.alive:  # the shared buffers' descriptors close with the collector, referenced or not
            self.requests, self.responses, self.versions = {}, {}, None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

