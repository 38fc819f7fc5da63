"""The error types every collector raises for problems that happen in another process.

A worker never dies silently: it catches every exception, sends back a :class:`RemoteFailure`
(worker index, exception type, message, formatted traceback), and the parent raises one
:class:`WorkerError` that names the worker and embeds the remote traceback. When the original
exception type is already loaded in the parent (a builtin exception, or a class of a module the
parent imported), the raised error is *also* an instance of that type, so ``except ValueError``
keeps working for a ``ValueError`` raised inside a worker's env. The parent never imports a module a
worker names (:func:`loaded_exception_class`): a node's message is not trusted to do that
(docs/security.md, "What a node's messages can do").

Every exception a page of ``docs/`` names is defined here, at the bottom of the package (this module
imports nothing of rlharvest), so that one import serves them all::

    from rlharvest.errors import CheckpointMismatchError, RestartLimitError, WorkerError

The modules that raise them import them from here.
"""

from __future__ import annotations

import builtins
import sys
import traceback
import types
from dataclasses import dataclass

__all__ = [
    "ActionKeyError",
    "ActionReadWarning",
    "ActionSpecError",
    "AddressNotAvailableError",
    "CheckpointMismatchError",
    "CollectorShutdownError",
    "CollectorUnreachable",
    "EpisodeRestartWarning",
    "EvaluationPendingError",
    "EvaluatorClosedError",
    "JoinRefused",
    "ParameterFreeModelError",
    "PortInUseError",
    "RemoteFailure",
    "RestartLimitError",
    "WeightNamesError",
    "WeightShapeError",
    "WorkerError",
    "WorkerTimeoutError",
    "loaded_exception_class",
]


class CollectorShutdownError(RuntimeError):
    """A call on a collector that was shut down (``shutdown()``, ``async_shutdown()``, or the end of a
    ``RayCollector``'s iteration): build a new collector to collect again.

    Example:
        >>> raise CollectorShutdownError("MultiSyncCollector is shut down")  # doctest: +SKIP
    """


class WorkerError(RuntimeError):
    """An exception raised in, or the death of, a worker (process, node or remote collector).

    Attributes:
        worker_idx: 0-based index of the worker (``None`` when unknown).
        noun: what the message calls the worker (``"worker"``, ``"node"``, ``"sub-env"``).
        remote_type: qualified name of the exception type raised remotely (``None`` for a death).
        remote_traceback: the formatted remote traceback, or ``""``.

    Example:
        >>> err = WorkerError("env exploded", worker_idx=1)
        >>> str(err)
        'worker 1: env exploded'
    """

    def __init__(
        self,
        message: str,
        *,
        worker_idx: int | None = None,
        remote_type: str | None = None,
        remote_traceback: str = "",
        noun: str = "worker",
    ) -> None:
        prefix = f"{noun} {worker_idx}: " if worker_idx is not None else ""
        text = prefix + message
        if remote_traceback:
            text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
        super().__init__(text)
        self.worker_idx = worker_idx
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.noun = noun

    def __str__(self) -> str:
        # The message as written, whatever else this error is: a mix-in of KeyError would otherwise
        # print the repr of its argument, the remote traceback as one escaped line.
        return self.args[0] if len(self.args) == 1 and isinstance(self.args[0], str) else super().__str__()

    def __reduce__(self):
        # The generated subclasses below are not importable by name: pickle as a plain WorkerError.
        return (
            _rebuild_worker_error,
            (str(self), self.worker_idx, self.remote_type, self.remote_traceback, self.noun),
        )


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A worker did not answer (or made no progress) within the allowed time."""


class RestartLimitError(WorkerError):
    """More workers failed than ``max_worker_restarts`` allows (docs/restarts.md, "Past the limit").

    Raised from the failure that exceeded the limit; its message lists every cause, oldest first.

    Attributes:
        causes: every restart's ``RestartCause`` (``rlharvest.collectors``), the failure that exceeded
            the limit last.
    """

    def __init__(self, message: str, causes: list, last: WorkerError) -> None:
        super().__init__(message, worker_idx=last.worker_idx, remote_type=last.remote_type,
                         remote_traceback=last.remote_traceback)
        self.causes = list(causes)


class _Readable:
    """A mix-in for errors whose message is a sentence: printed as written (a KeyError would print
    the repr of its argument, quotes and escaped newlines included)."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ActionKeyError(_Readable, KeyError):
    """The policy did not write an action key of the env (docs/collection.md, "Policies").

    A ``KeyError``, as the env's own lookup of the missing key would have been.

    Example:
        >>> print(ActionKeyError("the policy wrote no 'action'"))
        the policy wrote no 'action'
    """


class ActionSpecError(_Readable, ValueError):
    """The policy's action cannot be an action of the env's action spec (another number of values, or
    values the spec cannot hold), and the env failed at its first step with it: what TorchRL cannot run
    either (docs/collection.md, "Policies")."""


class ActionReadWarning(UserWarning):
    """The policy's first action does not fit the env's action spec (float logits for a one-hot spec,
    say), and the env took it as TorchRL's envs do: the warning names the spec and how it was read."""


class WeightNamesError(_Readable, KeyError):
    """Weights given to ``update_policy_weights_`` name other tensors than the parameters and buffers of
    the model they are for: the message lists the missing and the extra names, one per line
    (docs/weights.md, "What update_policy_weights_ accepts"). Raised before anything is sent.

    A ``KeyError``, as the lookup of a missing name in the model's weights would have been.
    """


class ParameterFreeModelError(WeightNamesError, RuntimeError):
    """Weights were given for a model without parameters or buffers (a policy over a function, the
    random policy), which cannot take them. Raised before anything is sent.

    Both a ``KeyError`` (a model without parameters lacks every name given) and a ``RuntimeError``
    (what a collector without a policy raises for weights it has nowhere to put).
    """


class WeightShapeError(_Readable, RuntimeError):
    """Weights given to ``update_policy_weights_`` hold a tensor of another shape than the model's
    parameter or buffer of that name (one that torch would broadcast into it included): the message
    names each and both shapes. Raised before anything is sent."""


class CheckpointMismatchError(ValueError):
    """A checkpoint that this collector cannot continue exactly: another format version, or a
    collector built with other arguments (number of workers, env batch size, batch layout).

    Example:
        >>> raise CheckpointMismatchError("num_workers: checkpoint 2, this collector 3")  # doctest: +SKIP
    """


class EpisodeRestartWarning(UserWarning):
    """An episode in flight at the checkpoint could not be continued: it restarts with a new trajectory id."""


class EvaluationPendingError(RuntimeError):
    """``trigger_eval`` with ``busy_policy="error"`` while an evaluation is pending or queued."""


class EvaluatorClosedError(RuntimeError):
    """An evaluation or a result was asked of an evaluator after ``Evaluator.shutdown()``."""


class PortInUseError(OSError):
    """A port a collector must listen on is taken."""


class AddressNotAvailableError(OSError):
    """A collector was asked to listen on an address (``bind_address``) that is not one of this host's."""


class JoinRefused(RuntimeError):
    """The collector refused a joining node: every slot is taken, or the node sends messages in another
    wire format (another rlharvest version); ``rlharvest node`` exits with 3."""


class CollectorUnreachable(ConnectionError):
    """A joining node found no collector at the address it was given within its ``--timeout``
    (``rlharvest node`` exits with 4)."""


def _rebuild_worker_error(text, worker_idx, remote_type, remote_traceback, noun="worker"):
    err = WorkerError.__new__(WorkerError)
    RuntimeError.__init__(err, text)
    err.worker_idx, err.remote_type, err.remote_traceback = worker_idx, remote_type, remote_traceback
    err.noun = noun
    return err


def loaded_exception_class(module: str, qualname: str) -> type[Exception] | None:
    """The exception class ``module.qualname`` if this process has it loaded already, else None.

    Only a builtin exception or a class of a module in ``sys.modules`` (a plain module), looked up in
    the module's and the classes' own ``__dict__`` (no import, no module ``__getattr__``, no
    descriptor runs), only a subclass of :class:`Exception` (never a ``SystemExit`` or a
    ``KeyboardInterrupt``), and only a class whose metaclass is ``type`` and whose bases, outside the
    builtins, define no ``__new__`` or ``__init_subclass__`` in Python: making its instance or a
    subclass of it (:meth:`RemoteFailure.to_exception`) runs no code of the module.

    Example:
        >>> loaded_exception_class("builtins", "ValueError")
        <class 'ValueError'>
        >>> loaded_exception_class("this", "Anything") is None  # not imported: never imported for it
        True
    """
    if type(module) is not str or type(qualname) is not str:
        return None
    found: object = builtins if module == "builtins" else sys.modules.get(module)
    if type(found) is not types.ModuleType:
        return None
    for part in qualname.split("."):
        namespace = found.__dict__ if type(found) in (types.ModuleType, type) else None
        if namespace is None:
            return None
        found = namespace.get(part)
    if type(found) is not type or not issubclass(found, Exception):
        return None
    for base in found.__mro__:
        if base.__module__ != "builtins" and ("__new__" in vars(base) or "__init_subclass__" in vars(base)):
            return None
    return found


_MIXED_TYPES: dict[type, type] = {}


def _mixed_error_type(remote_cls: type[BaseException]) -> type[WorkerError]:
    """A subclass of both WorkerError and ``remote_cls`` (cached), or WorkerError if impossible."""
    if issubclass(remote_cls, WorkerError):
        return WorkerError
    if remote_cls not in _MIXED_TYPES:
        try:
            mixed = type(f"Worker{remote_cls.__name__}", (WorkerError, remote_cls), {})
        except TypeError:  # incompatible layouts (e.g. some C-level exceptions)
            mixed = WorkerError
        _MIXED_TYPES[remote_cls] = mixed
    return _MIXED_TYPES[remote_cls]


def _blank_instance(cls: type[WorkerError]) -> WorkerError:
    """An instance of ``cls`` made by the constructor of the layout it has: a mix-in of an OSError
    type (TimeoutError, ConnectionError, ...) is laid out as an OSError, which RuntimeError's refuses."""
    for base in cls.__mro__:
        if "__new__" in vars(base):
            try:
                return base.__new__(cls)
            except TypeError:
                continue
    return WorkerError.__new__(WorkerError)


@dataclass(frozen=True)
class RemoteFailure:
    """What a worker sends back instead of a result when something raised."""

    worker_idx: int | None
    type_module: str
    type_name: str
    message: str
    traceback: str

    @classmethod
    def capture(cls, exc: BaseException, worker_idx: int | None) -> RemoteFailure:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(worker_idx, type(exc).__module__, type(exc).__qualname__, str(exc), tb)

    def to_exception(self, context: str = "", noun: str = "worker") -> WorkerError:
        """The exception to raise in the parent: a WorkerError that is also the remote type.

        Args:
            context: what the worker was doing (``"'step'"``), put before the remote message.
            noun: what the message calls the worker (``"sub-env 3: ..."``).
        """
        remote_cls = loaded_exception_class(self.type_module, self.type_name)
        cls = _mixed_error_type(remote_cls) if remote_cls is not None else WorkerError
        message = f"{self.type_name}: {self.message}"
        if context:
            message = f"{context} failed with {message}"
        err = _blank_instance(cls)
        WorkerError.__init__(
            err,
            message,
            worker_idx=self.worker_idx,
            remote_type=f"{self.type_module}.{self.type_name}",
            remote_traceback=self.traceback,
            noun=noun,
        )
        return err
