"""The wire types of the worker loop: what a parent sends a worker, what comes back, and what a
worker is built from. Both sides import this module (the collectors and the worker loop), and so do
the transports that carry the messages; it imports nothing of rlharvest but the error types.

See docs/backends.md for how a backend carries these messages.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .errors import RemoteFailure

__all__ = ["Command", "Message", "Reply", "WorkerOptions", "WorkerSpec", "EnvSettings", "Written", "FREE_BATCH",
           "LEAVING", "READY", "UnknownCommandError"]

#: what ``setattr_env`` set in a worker's env, ``((attribute path, value), ...)`` in the order set
EnvSettings = tuple


class Command(enum.Enum):
    """What a parent can ask a worker to do (one handler each in :class:`rlharvest.worker.Worker`)."""

    COLLECT = "collect"                  # payload: (random, interrupt mark) -> BATCH reply
    RUN_FREE = "run_free"                # collect continuously (into the replay buffer, or pushed)
    PAUSE = "pause"                      # stop running free (reply once no write is in flight)
    RESUME = "resume"
    SEED = "seed"                        # payload: (seed, static_seed) -> next seed
    RESET = "reset"                      # payload: None or reset kwargs
    STATE_DICT = "state_dict"            # payload: None or state_dict kwargs ({"env_state": False})
    LOAD_STATE_DICT = "load_state_dict"  # payload: state dict -> [(warning category, message)]
    GETATTR_POLICY = "getattr_policy"    # payload: attribute name
    GETATTR_ENV = "getattr_env"          # payload: attribute name
    CASCADE = "cascade_execute"          # payload: (attr_path, args, kwargs)
    ENABLE_PROFILE = "enable_profile"    # payload: ProfileConfig
    ATTACH_BUFFER = "attach_buffer"      # payload: replay-buffer storage -> Written (its totals)
    RESIZE = "resize"                    # payload: frames per rollout from the next one -> the frames it collects
    CLOSE = "close"


#: request id of the reply every worker sends once it is built (or failed to build)
READY = -1
#: request ids at or below this mark unsolicited batches of a worker running free (never answered ids)
FREE_BATCH = -2
#: request id of the message a preempted worker sends before it exits (no request has id 0)
LEAVING = 0


class UnknownCommandError(ValueError):
    """A message whose command is not a :class:`Command`."""


@dataclass
class Message:
    """One command from the parent; ``request_id`` comes back in the :class:`Reply`."""

    command: Command
    request_id: int
    payload: Any = None


@dataclass(frozen=True)
class Written:
    """What a collector wrote to its replay buffer, for ``stats()``'s progress keys (TorchRL's next
    release). A worker writing the buffer itself keeps its totals since it was built: it sends them
    with each batch and, where its transport has a shared row, advertises them after each write
    (running free too); its parent counts what is new (docs/restarts.md, "Watching a run")."""

    frames: int = 0
    """Steps written."""
    trajectory_frames: int = 0
    """Steps of the trajectories that ended (complete trajectories assembled)."""
    trajectories: int = 0
    """Trajectories that ended."""
    pending_frames: int = 0
    """Steps of the trajectories that have not ended yet: a gauge, as of the report."""
    free_frames: int = 0
    """Steps collected running free (``start()``): no batch carried them to the parent."""
    reports: int = 0
    """A worker's totals: how many times they changed (of two reports, the later has more)."""

    def __add__(self, later: Written) -> Written:
        """This report followed by ``later`` (the pending steps are ``later``'s)."""
        return Written(self.frames + later.frames, self.trajectory_frames + later.trajectory_frames,
                       self.trajectories + later.trajectories, later.pending_frames,
                       self.free_frames + later.free_frames, self.reports + later.reports)

    def __sub__(self, earlier: Written) -> Written:
        """What was written since ``earlier`` (the pending steps are this report's)."""
        return Written(self.frames - earlier.frames, self.trajectory_frames - earlier.trajectory_frames,
                       self.trajectories - earlier.trajectories, self.pending_frames,
                       self.free_frames - earlier.free_frames, self.reports - earlier.reports)


@dataclass
class Reply:
    """A worker's answer to one :class:`Message` (or its READY reply, or a batch pushed while free)."""

    request_id: int
    worker_idx: int
    value: Any = None
    failure: RemoteFailure | None = None
    #: for BATCH replies: valid frames, and whether the batch went to the replay buffer (its ``value`` is
    #: then a :class:`Written`: the worker's totals)
    frames: int = 0
    written: bool = False
    #: for BATCH replies: seconds the worker's env and policy took for it (``stats()``), or None
    times: tuple[float, float] | None = None
    #: the name of the host the worker runs on, in its first BATCH reply (``stats()``), else None
    host: str | None = None


class WorkerOptions(Protocol):
    """The typed options of a worker's collector when it is one of rlharvest's (``LocalOptions``, or
    ``WorkerProcessOptions`` for a node running worker processes), parsed and validated in the parent."""

    @property
    def config(self) -> Any:
        """The collector's ``CollectorConfig``."""

    def with_hooks(self, hooks: dict) -> WorkerOptions:
        """These options with the pre/post-collect ``hooks`` (``{name: hook}``) set."""

    def in_worker(self, *, create_env_fn: Any, policy: Any, policy_factory: Any, worker_idx: int) -> WorkerOptions:
        """The options the worker builds its collector from: its env constructor and policy, made in the
        worker, and its index."""


@dataclass
class WorkerSpec:
    """Everything a worker is built from, identity included.

    The parent keeps one spec per worker for as long as the collector lives: a replacement for a
    worker that failed is started from the same spec (see :meth:`replacement`), so nothing about a
    worker's identity lives only in its process.
    """

    worker_idx: int
    """The worker's index in its collector (0-based); never changes, also across replacements."""
    collector_class: Callable[..., Any]
    """The class of the worker's collector (wrapped for pickling where it may be the user's)."""
    create_env_fn: Any
    """The worker's env constructor (or env), or one per sub-worker of a node running worker processes."""
    collector_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the worker's collector when it is a class of the user's own (from
    ``CollectorConfig.for_worker``); empty when ``options`` is given."""
    options: WorkerOptions | None = None
    """The typed options of the worker's collector when it is one of rlharvest's, parsed and validated
    in the parent (``collector_class.from_options`` builds it: nothing is parsed again in the worker);
    None for a class of the user's own, built from ``collector_kwargs``."""
    policy: Any = None
    policy_factory: Any = None
    weight_recv_schemes: dict | None = None
    replay_buffer: Any = None
    num_threads: int = 1
    init_random_frames: int = 0
    """Frames of random actions when running free (decided from the buffer's write count)."""
    init_fn: Any = None
    """Called in the worker before it builds its env and collector."""
    seed: int | None = None
    """The seed the parent last gave this worker (``set_seed``); a replacement is seeded with it."""
    static_seed: bool = False
    traj_offset: int = 0
    """Added to every trajectory id the worker's collector hands out: a replacement starts past the
    ids its predecessor used, so ids stay unique (docs/collection.md, "Trajectory ids")."""
    policy_version: int = 0
    """The policy version the worker starts at (a replacement starts at the current one)."""
    preemption_grace: float | None = None
    """Seconds a worker that receives SIGTERM has to finish its rollout before it hands it back and
    leaves (None: SIGTERM is not handled, the process ends at once). docs/elastic.md."""
    env_settings: EnvSettings = ()
    """What ``setattr_env`` set in this worker's env, ``((attribute path, value), ...)`` in order: the
    worker sets them once its collector is built, before its first step (a replacement, an added
    worker: docs/collection.md, "Reconfiguring running envs")."""
    restart: int = 0
    """How many failed workers this one replaces at its index (0: the first); a restarted worker's env
    is seeded from its worker's seed and this number (:meth:`start_seed`)."""

    def start_seed(self) -> int | None:
        """The seed the worker is built with: ``seed``, or for restart ``k > 0`` a seed derived from
        (``seed``, ``worker_idx``, ``k``), the same for the same restart, different from every other
        restart's and from the first worker's (docs/restarts.md, "Seeds")."""
        if not self.restart:
            return self.seed
        words = [self.worker_idx, self.restart] + ([] if self.seed is None else [self.seed % 2**63])
        value = 0x9E3779B97F4A7C15  # splitmix64 over the words: cheap, deterministic, well mixed
        for word in words:
            value = (value ^ word) * 0xBF58476D1CE4E5B9 % 2**64
            value = (value ^ (value >> 31)) * 0x94D049BB133111EB % 2**64
        return int(value >> 33)  # 31 bits: every env's seed() takes it

    def with_hooks(self, hooks: dict) -> WorkerSpec:
        """This spec with the pre/post-collect ``hooks`` (``{name: hook}``) given to its collector."""
        if self.options is not None:
            return dataclasses.replace(self, options=self.options.with_hooks(hooks))
        return dataclasses.replace(self, collector_kwargs={**self.collector_kwargs, **hooks})

    def replacement(self, **changes: Any) -> WorkerSpec:
        """The spec of a new worker taking this one's place (same index), with ``changes`` applied."""
        if "worker_idx" in changes and changes["worker_idx"] != self.worker_idx:
            raise ValueError("a replacement keeps the worker_idx of the worker it replaces.")
        return dataclasses.replace(self, **changes)
