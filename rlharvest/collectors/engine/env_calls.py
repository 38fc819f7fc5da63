"""Reconfiguring the envs of a running collector: ``setattr_env``, ``call_env``, ``getattr_env``
(docs/collection.md, "Reconfiguring running envs").

What ``setattr_env`` set lasts: it is recorded in each targeted worker's spec, the route a seed takes
(docs/backends.md, "Replacing a worker"), so a replacement is built with it before its first step; what
was set on every worker is also given to workers added later (``add_collectors``, nodes that join);
a checkpoint carries both. ``call_env`` is a call, not a setting: nothing of it is recorded.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Sequence

from ...envs.reconfigure import EnvOp, EnvOpKind, reconfigure_env
from ...errors import WorkerError
from ...protocol import Command, EnvSettings
from .fleet import Fleet

__all__ = ["EnvCalls", "LocalEnvCalls", "with_setting"]


def with_setting(settings: EnvSettings, name: str, value: Any) -> EnvSettings:
    """``settings`` with ``name`` set to ``value`` (last, replacing an earlier value of ``name``)."""
    return (*((key, old) for key, old in settings if key != name), (name, value))


def _check_name(name: Any) -> str:
    """Raises: ValueError naming ``name`` unless it is a non-empty attribute path."""
    EnvOp(EnvOpKind.GET, name)
    return name


class LocalEnvCalls:
    """The env of a ``Collector`` (in this process, or a worker's), reconfigured where it is.

    Args:
        env: the collector's env.
        name: how messages name the collector.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> calls = LocalEnvCalls(CountingEnv(max_steps=5), "Collector")
        >>> calls.setattr("max_steps", 9, None)
        >>> calls.getattr("max_steps"), calls.settings
        (9, (('max_steps', 9),))
    """

    def __init__(self, env: Any, name: str) -> None:
        self.env = env
        self.name = name
        #: what ``setattr_env`` set, in order (a checkpoint carries it)
        self.settings: EnvSettings = ()

    def _no_workers(self, worker_ids: Any) -> None:
        if worker_ids is not None:
            raise ValueError(f"worker_ids={worker_ids!r}: a {self.name} has no workers (give None).")

    def setattr(self, name: str, value: Any, worker_ids: Any) -> None:
        self._no_workers(worker_ids)
        reconfigure_env(self.env, EnvOp(EnvOpKind.SET, name, value))
        self.settings = with_setting(self.settings, name, value)

    def call(self, name: str, args: tuple, kwargs: dict, worker_ids: Any) -> list[Any]:
        self._no_workers(worker_ids)
        return [reconfigure_env(self.env, EnvOp(EnvOpKind.CALL, name, args=args, kwargs=kwargs))]

    def getattr(self, name: str) -> Any:
        return reconfigure_env(self.env, EnvOp(EnvOpKind.GET, name))

    def restore(self, settings: Sequence) -> None:
        """Set again what a checkpoint says was set (its env's state may not have been kept)."""
        for name, value in settings:
            self.setattr(name, value, None)


class EnvCalls:
    """The workers' envs, reconfigured through their collectors (one command per targeted worker, sent
    to all before any answer is awaited).

    Args:
        fleet: the workers (their specs record what was set).
        drop: called first: in-flight rollouts are awaited and their batches dropped, so every frame
            collected after a ``setattr_env`` comes from envs that have it.
        boundary: a block in which no batch is being collected (``start()``'s thread pauses).
        noun: how messages name a worker.

    Example:
        >>> calls = EnvCalls(fleet, lambda: None, contextlib.nullcontext)      # doctest: +SKIP
        >>> calls.setattr("max_steps", 9, None)                               # doctest: +SKIP
    """

    def __init__(self, fleet: Fleet, drop: Callable[[], None], boundary: Callable[[], ContextManager],
                 noun: str = "worker") -> None:
        self.fleet = fleet
        self.drop = drop
        self.boundary = boundary
        self.noun = noun
        #: what was set on every worker: workers added later start with it
        self.common: EnvSettings = ()

    def targets(self, worker_ids: Any) -> list[int]:
        """The workers ``worker_ids`` names (None: every current one).

        Raises:
            ValueError: for an index that is not a current worker, or an empty list.
        """
        active = self.fleet.active
        if worker_ids is None:
            return list(active)
        if isinstance(worker_ids, int):
            ids = [worker_ids]
        else:
            ids = list(worker_ids) if isinstance(worker_ids, (list, tuple, range)) else []
        if not ids or any(type(w) is not int or w not in active for w in ids):
            raise ValueError(f"worker_ids={worker_ids!r}: give None (every {self.noun}), or an index or a non-empty "
                             f"list of the current {self.noun}s {active}.")
        return sorted(set(ids))

    def _ask(self, workers: list[int], method: str, args: tuple, kwargs: dict) -> dict[int, Any]:
        """``method(*args, **kwargs)`` in each worker's collector; a worker that died meanwhile is
        replaced as the restart policy allows (its spec holds what was set), and answers as
        the replacement built.

        Raises:
            WorkerError: naming the first worker where the call failed.
        """
        requests = self.fleet.requests
        asked, answers, failure = {}, {}, None
        for worker in workers:
            try:
                asked[worker] = requests.send(worker, Command.CASCADE, (method, args, kwargs))
            except WorkerError as err:
                self.fleet.recover(err)
                asked[worker] = requests.send(worker, Command.CASCADE, (method, args, kwargs))
        for worker in workers:
            try:
                answers[worker] = requests.wait_for(worker, asked[worker]).value
            except WorkerError as err:
                if err.remote_type is not None:  # the call failed there: the caller's mistake, raised
                    failure = failure or err
                    continue
                self.fleet.recover(err)  # died: its replacement starts from its spec
                answers[worker] = requests.request(worker, Command.CASCADE, (method, args, kwargs))
        if failure is not None:
            raise failure
        return answers

    def setattr(self, name: str, value: Any, worker_ids: Any) -> None:
        """Set ``name`` to ``value`` in the env of every targeted worker; returns once each has it.

        Raises:
            ValueError: for ``worker_ids`` that name no current worker, or an empty ``name``.
            WorkerError: naming the first worker where it failed (nothing is recorded then).
        """
        _check_name(name)
        workers = self.targets(worker_ids)
        fleet = self.fleet
        before = {worker: fleet.specs[worker] for worker in workers}
        for worker, spec in before.items():  # first: a worker that dies meanwhile is rebuilt with it
            if spec is not None:
                fleet.remember(worker, env_settings=with_setting(spec.env_settings, name, value))
        try:
            with self.boundary():
                self.drop()
                self._ask(workers, "setattr_env", (name, value), {})
        except BaseException:
            for worker, spec in before.items():
                if spec is not None and fleet.specs[worker] is not None:
                    fleet.remember(worker, env_settings=spec.env_settings)
            raise
        if worker_ids is None:
            self.common = with_setting(self.common, name, value)

    def call(self, name: str, args: tuple, kwargs: dict, worker_ids: Any) -> list[Any]:
        """The method ``name`` of each targeted worker's env called once; the results in worker order.

        Raises:
            ValueError: for ``worker_ids`` that name no current worker, or an empty ``name``.
            WorkerError: naming the first worker where the call failed (the original type kept).
        """
        _check_name(name)
        workers = self.targets(worker_ids)
        with self.boundary():
            answers = self._ask(workers, "call_env", (name, *args), kwargs)
        return [answers[worker][0] if isinstance(answers[worker], list) and len(answers[worker]) == 1
                else answers[worker] for worker in workers]

    def getattr(self, name: str) -> Any:
        """The attribute at ``name`` of the first current worker's env."""
        _check_name(name)
        return self.fleet.requests.request(self.fleet.active[0], Command.GETATTR_ENV, name)

    # ------------------------------------------------------------------ workers to come, checkpoints
    def for_new_worker(self) -> EnvSettings:
        """What a worker added now starts with: what was set on every worker."""
        return self.common

    def state(self) -> dict:
        """The checkpoint's part: what was set on every worker, and on each."""
        return {"env_settings": {"common": list(self.common),
                                 "workers": [list(spec.env_settings) if spec is not None else None
                                             for spec in self.fleet.specs]}}

    def restore(self, section: dict) -> None:
        """Continue with what ``section`` says was set: recorded for replacements and set again in
        every current worker (its env's state may not have been kept)."""
        saved = section.get("env_settings")
        if saved is None:
            return
        self.common = tuple((name, value) for name, value in saved["common"])
        for worker, settings in enumerate(saved["workers"]):
            if settings is None or worker >= len(self.fleet.specs) or self.fleet.specs[worker] is None:
                continue
            for name, value in settings:
                if worker in self.fleet.active:
                    self._ask([worker], "setattr_env", (name, value), {})
            self.fleet.remember(worker, env_settings=tuple((name, value) for name, value in settings))
