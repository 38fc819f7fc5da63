"""What a collector with workers answers by asking its workers: one command per worker.

Seeds (chained across workers), state dicts (one per worker), resets, ``map_fn``, attributes,
``cascade_execute`` into workers, per-worker ``stats``, hooks, version bumps and profiling. Before
each, the collector's in-flight asynchronous rollouts are drained (``drain``: nothing is lost, their
batches are kept for the iterator); what a replacement must start with (its seed, its hooks) is
recorded in the worker's spec on the fleet (docs/backends.md, "Replacing a worker").
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Sequence

from ...errors import WorkerError
from ...profiling import ProfileConfig
from ...protocol import Command
from .fleet import Fleet
from ..._utils import user_stacklevel, wrap_callable

__all__ = ["WorkerBroadcast", "LocalCalls", "argument_sets"]


def argument_sets(list_of_args, list_of_kwargs, count: int | None) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` pairs for ``map_fn``; ``count`` = the number of calls required (None: any).

    Raises:
        ValueError: for lists of different lengths, or not ``count`` entries.
    """
    if list_of_args is None and list_of_kwargs is None:
        list_of_args = [()] * (count if count is not None else 1)
    if list_of_args is None:
        list_of_args = [()] * len(list_of_kwargs)
    if list_of_kwargs is None:
        list_of_kwargs = [{}] * len(list_of_args)
    if len(list_of_args) != len(list_of_kwargs):
        raise ValueError(f"list_of_args and list_of_kwargs must have the same length, got {len(list_of_args)} "
                         f"and {len(list_of_kwargs)}.")
    if count is not None and len(list_of_args) != count:
        raise ValueError(f"Expected {count} argument entries (one per worker), got {len(list_of_args)}.")
    return [(tuple(args), dict(kwargs)) for args, kwargs in zip(list_of_args, list_of_kwargs)]


class WorkerBroadcast:
    """Commands a collector sends to every worker (or a chosen few), through its fleet.

    Args:
        fleet: the collector's workers.
        drain: called before each call, to let in-flight rollouts answer first.
        noun: how errors name a worker ("worker", "node", "actor").
        policy_here: the policy when it runs in this process (a policy server), asked instead of the
            first worker's; None otherwise.

    Example:
        >>> broadcast = WorkerBroadcast(fleet, drain=lambda: None)         # doctest: +SKIP
        >>> broadcast.seed(range(2), 7, static_seed=False)                 # doctest: +SKIP
        9
    """

    def __init__(self, fleet: Fleet, drain: Callable[[], None], noun: str = "worker", policy_here: Any = None) -> None:
        self.fleet = fleet
        self.drain = drain
        self.noun = noun
        self.policy_here = policy_here
        #: what the last :meth:`seed` returned, and its ``static_seed``: workers added later continue there
        self.seed_chain: tuple[int, bool] | None = None

    @property
    def _requests(self):
        return self.fleet.requests

    def _all(self) -> list[int]:
        """The workers that have not left (docs/elastic.md)."""
        return self.fleet.active

    # ------------------------------------------------------------------ seeds and state
    def seed(self, workers: Iterable[int], seed: int, static_seed: bool) -> int:
        """Seed ``workers`` in order, each with what the one before returned; a replacement is seeded
        the same. Returns the last seed."""
        for worker in workers:
            self.fleet.remember(worker, seed=seed, static_seed=static_seed)
            seed = self._requests.request(worker, Command.SEED, (seed, static_seed))
        self.seed_chain = (seed, static_seed)
        return seed

    def state_dicts(self, env_state: bool = True) -> dict[str, Any]:
        """``{"worker<i>": state of worker i}`` (without the envs' states when not ``env_state``;
        workers that left have none)."""
        self.drain()
        options = None if env_state else {"env_state": False}
        return {f"worker{w}": self._requests.request(w, Command.STATE_DICT, options) for w in self._all()}

    def load_state_dicts(self, state_dict: dict) -> None:
        """Give worker i the entry ``"worker<i>"`` of ``state_dict`` (workers without one keep theirs);
        the warnings a worker's load raised (an episode that restarts) are raised here."""
        self.drain()
        for worker in self._all():
            key = f"worker{worker}"
            if key in state_dict:
                raised = self._requests.request(worker, Command.LOAD_STATE_DICT, state_dict[key])
                for category, message in _raised_warnings(raised, worker):
                    warnings.warn(message, category, stacklevel=user_stacklevel())

    def reset(self, workers: Sequence[int] | None = None) -> None:
        """Reset the envs of ``workers`` (default: every worker)."""
        self.drain()
        self._requests.broadcast(Command.RESET, None, list(workers) if workers is not None else None)

    # ------------------------------------------------------------------ calls into the workers' collectors
    def call_each(self, method_name: str, calls: Sequence[tuple[tuple, dict]]) -> list[Any]:
        """Call ``method_name`` on the ``k``-th current worker's collector with ``calls[k]`` (one per
        current worker, in index order)."""
        self.drain()
        workers = self._all()
        ids = {w: self._requests.send(w, Command.CASCADE, (method_name, *call)) for w, call in zip(workers, calls)}
        return [self._requests.wait_for(w, ids[w]).value for w in workers]

    def call(self, path: str, args: tuple = (), kwargs: dict | None = None,
             workers: Iterable[int] | None = None) -> list[Any]:
        """``path`` resolved (and called with the arguments) in each worker's collector."""
        workers = self._all() if workers is None else workers
        return [self._requests.request(w, Command.CASCADE, (path, args, kwargs or {})) for w in workers]

    def get_attr(self, attr: str) -> list[Any]:
        """The attribute at ``attr`` in every worker's collector, in worker order."""
        return self._requests.broadcast(Command.CASCADE, ("get_distant_attr", (attr,), {}))

    def map_fn(self, method_name: str, list_of_args: Sequence | None, list_of_kwargs: Sequence | None) -> list[Any]:
        """``map_fn``: ``method_name`` called in the ``k``-th current worker's collector with the ``k``-th
        arguments (one entry per current worker).

        Raises:
            ValueError: for lists of different lengths, or not one entry per worker.
        """
        return self.call_each(method_name, argument_sets(list_of_args, list_of_kwargs, len(self._all())))

    def cascade(self, attr_path: str, args: tuple, kwargs: dict) -> Any:
        """``cascade_execute("workers[i].<path>")`` runs inside worker i's collector (its result),
        ``"workers.<path>"`` inside every worker (their results, in worker order).

        Raises:
            ValueError: when nothing follows ``workers[i].``.
        """
        head, _, rest = attr_path.partition(".")
        if not rest:
            raise ValueError(f"{attr_path!r}: give the path to run inside the worker after 'workers[i].'")
        workers = self._all() if head == "workers" else [int(head[len("workers["):-1])]
        results = self.call(rest, args, kwargs, workers)
        return results if head == "workers" else results[0]

    def getattr_policy(self, name: str) -> Any:
        if self.policy_here is not None:  # the policy lives here (AsyncBatchedCollector)
            return getattr(self.policy_here, name)
        return self._requests.request(self._all()[0], Command.GETATTR_POLICY, name)

    def policy_versions(self) -> dict[int, Any]:
        """``{worker: the policy version it reports}`` for every current worker."""
        workers = self._all()
        return dict(zip(workers, self.call_each("get_policy_version", [((), {})] * len(workers))))

    def worker_stats(self) -> list[dict]:
        """Each worker's own ``stats()``."""
        return self.call_each("stats", [((), {})] * len(self._all()))

    def stats_within(self, timeout: float | None) -> dict[int, dict]:
        """``{worker: its stats()}`` of the workers that answer within ``timeout`` seconds (None: no
        limit); a worker that is dead, fails or is late is left out, and nothing is raised (for
        monitoring: a worker busy with a rollout answers after it)."""
        requests = self._requests
        asked = {}
        for worker in self._all():
            if not requests.is_dead(worker):
                try:
                    asked[worker] = requests.send(worker, Command.CASCADE, ("stats", (), {}))
                except WorkerError:  # found dead: it does not count as alive
                    pass
        return requests.values_within(asked, timeout)

    # ------------------------------------------------------------------ hooks and versions
    def set_hook(self, name: str, hook: Callable | None) -> None:
        """Set the hook ``name`` (``"pre_collect_hook"``, ``"post_collect_hook"``) in every worker, and
        in every spec so that a replacement or an added worker gets it too."""
        self.drain()
        wrapped = wrap_callable(hook)
        self._requests.broadcast(Command.CASCADE, (f"set_{name}", (wrapped,), {}))
        for worker, spec in enumerate(self.fleet.specs):
            if spec is not None:
                self.fleet.specs[worker] = spec.with_hooks({name: wrapped})

    def increment_version(self) -> None:
        self.drain()
        self._requests.broadcast(Command.CASCADE, ("increment_version", (), {}))

    # ------------------------------------------------------------------ profiling
    def enable_profile(self, config: ProfileConfig) -> None:
        workers = [w for w in config.workers if w in self._all()]
        replies = self._requests.broadcast(Command.ENABLE_PROFILE, config, workers, timeout=30.0)
        for worker, reply in zip(workers, replies):
            if reply != "profiling":
                raise RuntimeError(f"{self.noun} {worker} answered {reply!r} to enable_profile.")

    def disable_profile(self) -> None:
        self.drain()
        self._requests.broadcast(Command.CASCADE, ("disable_profile", (), {}))


class LocalCalls:
    """What a ``Collector`` answers of the calls :class:`WorkerBroadcast` asks workers: from this process.

    Args:
        resolve: the object at an attribute path of the collector.
        policy: the policy it runs now.
        name: how messages name the collector.
    """

    def __init__(self, resolve: Callable[[str], Any], policy: Callable[[], Any], name: str) -> None:
        self.resolve = resolve
        self.policy = policy
        self.name = name

    def get_attr(self, attr: str) -> Any:
        return self.resolve(attr)

    def map_fn(self, method_name: str, list_of_args: Sequence | None, list_of_kwargs: Sequence | None) -> list[Any]:
        method = self.resolve(method_name)
        return [method(*args, **kwargs) for args, kwargs in argument_sets(list_of_args, list_of_kwargs, None)]

    def cascade(self, attr_path: str, args: tuple, kwargs: dict) -> Any:
        """Raises: AttributeError: a ``Collector`` has no workers to run ``workers[i].<path>`` in."""
        raise AttributeError(f"{attr_path!r}: a {self.name} has no workers to run it in.")

    def getattr_policy(self, name: str) -> Any:
        return getattr(self.policy(), name)


def _raised_warnings(raised: Any, worker: int) -> list[tuple[type[Warning], str]]:
    """The ``(category, message)`` pairs a worker says its ``load_state_dict`` raised.

    Raises:
        WorkerError: for any other answer (a node's answer is not trusted to be one).
    """
    if raised is None:
        return []
    if type(raised) is list and all(type(pair) is tuple and len(pair) == 2 and isinstance(pair[0], type)
                                    and issubclass(pair[0], Warning) and type(pair[1]) is str for pair in raised):
        return raised
    raise WorkerError(f"answered load_state_dict with a {type(raised).__name__}, not the warnings it raised.",
                      worker_idx=worker)
