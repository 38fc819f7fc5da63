"""TorchRL's weight-sync scheme objects given to an rlharvest collector: each becomes rlharvest's
scheme of the same kind, with the same settings (docs/torchrl-compatibility.md, "Weight-sync schemes").

A user who switched the collector imports keeps building ``torchrl.weight_update`` schemes. Their
internals drive TorchRL's own transports and read TorchRL's collectors; rlharvest never calls them.
It reads the settings their constructors stored (never calling a member, never importing torchrl)
and builds its own scheme of that kind, which moves the same model to the same workers. A TorchRL
scheme rlharvest has no equivalent of, a subclass of one (its code would be skipped) and one
already initialised (it holds TorchRL's transport) are refused, naming the argument.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from .backends import scheme_class
from .schemes import WeightSyncScheme

__all__ = ["own_schemes", "TRANSLATED"]

#: TorchRL's schemes with an rlharvest equivalent, by class name: the ``from_backend`` name of ours, and
#: ``{our constructor argument: the attribute TorchRL's constructor stores it in}``
TRANSLATED: dict[str, tuple[str, dict[str, str]]] = {
    "NoWeightSyncScheme": ("none", {"strategy": "strategy_str"}),
    "SharedMemWeightSyncScheme": ("shared", {"strategy": "strategy_str", "sync": "sync",
                                             "per_worker_weights": "per_worker_weights"}),
    "MultiProcessWeightSyncScheme": ("process", {"strategy": "strategy_str", "sync": "sync"}),
    "DistributedWeightSyncScheme": ("distributed", {"backend": "backend", "sync": "sync", "timeout": "_timeout"}),
    "RPCWeightSyncScheme": ("rpc", {"strategy": "strategy_str"}),
    "RayWeightSyncScheme": ("ray", {"strategy": "strategy_str", "backend": "_backend"}),
}

_TORCHRL = "torchrl.weight_update"
_ACCEPTED = ("Accepted: the schemes of rlharvest.weight_update, or TorchRL's " + ", ".join(TRANSLATED)
             + " as constructed (rlharvest runs its own scheme of the same kind, with the same settings).")


def own_schemes(schemes: Any, argument: str, receiving: bool = False) -> dict[str, WeightSyncScheme] | None:
    """``schemes`` (``{model_id: scheme}`` or None) with every scheme rlharvest's: TorchRL's are translated.

    Args:
        schemes: what the user gave as ``argument``.
        argument: the argument's name, for errors (``"weight_sync_schemes"``, ``"weight_recv_schemes"``).
        receiving: whether the schemes are receivers (a TorchRL one is refused: its sender is TorchRL's).

    Raises:
        TypeError: for something other than a dict of model ids to schemes, a TorchRL scheme rlharvest
            has no equivalent of, a subclass of a TorchRL scheme, or a TorchRL receiver.
        ValueError: for a TorchRL scheme already initialised.

    Example:
        >>> from rlharvest.weight_update import SharedMemWeightSyncScheme
        >>> own_schemes({"policy": SharedMemWeightSyncScheme()}, "weight_sync_schemes")
        {'policy': SharedMemWeightSyncScheme(model_id=None, role=idle, version=0)}
    """
    if schemes is None:
        return None
    if not isinstance(schemes, Mapping):
        raise TypeError(f"{argument} must be a dict {{model_id: scheme}} or None, got {type(schemes).__name__}.")
    owned = {}
    for model_id, scheme in schemes.items():
        if not isinstance(model_id, str):
            raise TypeError(f"{argument} maps model ids (str, e.g. 'policy') to schemes, got the key {model_id!r}.")
        where = f"{argument}[{model_id!r}]"
        if receiving and not isinstance(scheme, WeightSyncScheme) and _torchrl_base(type(scheme)) is not None:
            raise TypeError(f"{where} is TorchRL's {type(scheme).__qualname__}: a receiver is the copy of its "
                            "sender's scheme a worker is given, and only an rlharvest collector's sender reaches "
                            "rlharvest's receivers. Pass the schemes of rlharvest.weight_update.")
        owned[model_id] = _own(scheme, where)
    return owned


def _torchrl_base(cls: type) -> type | None:
    """The first class of ``cls``'s MRO that ``torchrl.weight_update`` defines, or None."""
    return next((base for base in cls.__mro__ if base.__module__ == _TORCHRL
                 or base.__module__.startswith(_TORCHRL + ".")), None)


def _own(scheme: Any, where: str) -> WeightSyncScheme:
    if isinstance(scheme, WeightSyncScheme):
        return scheme
    cls = type(scheme)
    torchrl_base = _torchrl_base(cls)
    if torchrl_base is None:
        raise TypeError(f"{where} must be a weight-sync scheme, got {cls.__module__}.{cls.__qualname__}. {_ACCEPTED}")
    name = torchrl_base.__qualname__
    if torchrl_base is not cls:
        raise TypeError(f"{where} is a {cls.__qualname__}, a subclass of TorchRL's {name}: rlharvest runs its own "
                        "schemes, which would skip your subclass's code. Subclass rlharvest.weight_update's "
                        f"{name if name in TRANSLATED else 'WeightSyncScheme'} instead. {_ACCEPTED}")
    if name not in TRANSLATED:
        raise TypeError(f"{where} is TorchRL's {name}, which rlharvest has no equivalent of. {_ACCEPTED}")
    settings = vars(scheme)
    if settings.get("_initialized_on_sender") or settings.get("_initialized_on_receiver"):
        raise ValueError(f"{where} is TorchRL's {name} already initialised (init_on_sender or init_on_receiver "
                         "was called on it: it holds TorchRL's transport). Pass it as constructed, or "
                         f"rlharvest.weight_update.{name}.")
    backend, arguments = TRANSLATED[name]
    with warnings.catch_warnings():  # TorchRL's constructor already said that state_dict is experimental
        warnings.filterwarnings("ignore", message=r"WeightStrategy\(extract_as='state_dict'\) is experimental")
        return scheme_class(backend)(**{ours: settings[theirs] for ours, theirs in arguments.items()
                                        if theirs in settings})
