"""Weight-sync schemes for worker processes: thin layers over ``transport.shared_memory``."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..transport.mp import mp_context
from ..transport.shared_memory import SharedMemLinks, SharedMemWeightReceiver, SharedMemWeightSender
from .schemes import WeightSyncScheme
from .strategy import weights_of

__all__ = ["SharedMemWeightSyncScheme", "MultiProcessWeightSyncScheme", "WEIGHT_SYNC_TIMEOUT"]

#: default seconds to wait for initial weights and for acknowledgements
WEIGHT_SYNC_TIMEOUT = 120.0


class SharedMemWeightSyncScheme(WeightSyncScheme):
    """Weights staged in shared memory; workers copy them between two env steps and acknowledge.

    Args:
        strategy: weight format (``"tensordict"``).
        sync: ``send`` waits for every targeted worker's acknowledgement.
        per_worker_weights: one staging buffer per worker, so ``update_policy_weights_({i: w})``
            can give each worker its own weights (distinct policy factories).
        timeout: seconds to wait for initial weights and acknowledgements.

    ``init_on_sender`` accepts exactly one weight source: ``context`` + ``model_id`` (what
    collectors do), ``model=`` or ``weights=`` (with ``devices=`` per worker, or ``device_map_fn=``
    and ``num_workers=``), or ``params_map={worker_idx: weights}``.

    Example:
        >>> from rlharvest.collectors import MultiSyncCollector                # doctest: +SKIP
        >>> scheme = SharedMemWeightSyncScheme()                               # doctest: +SKIP
        >>> collector = MultiSyncCollector([make_env] * 2, policy, frames_per_batch=100,
        ...                                weight_sync_schemes={"policy": scheme})  # doctest: +SKIP
    """

    needs_workers = True
    supports_per_worker_weights = True
    _via_pipe = False

    def __init__(self, strategy: str = "tensordict", sync: bool = True, per_worker_weights: bool = False,
                 timeout: float = WEIGHT_SYNC_TIMEOUT) -> None:
        super().__init__(strategy=strategy, sync=sync, timeout=timeout)
        self.per_worker_weights = per_worker_weights
        self._params_map: dict[int, Any] | None = None
        self._explicit_weights: Any = None
        self._last_payload: Any = None

    def init_on_sender(self, *, model_id: str = "policy", context=None, model=None, weights=None,
                       devices: list | None = None, params_map: dict | None = None,
                       device_map_fn: Callable[[int], Any] | None = None, num_workers: int | None = None,
                       ctx=None, **kwargs) -> None:
        """Prepare staging buffers and channels for ``num_workers`` workers (see the class doc).

        Raises:
            ValueError: for conflicting weight sources or a missing worker count.
        """
        if self.initialized_on_sender:
            return super().init_on_sender(model_id=model_id, context=context)  # learns its collector
        sources = [name for name, value in (("model", model), ("weights", weights), ("params_map", params_map))
                   if value is not None]
        if len(sources) > 1:
            raise ValueError(f"Give one weight source to init_on_sender, got {sources}.")
        if device_map_fn is not None and weights is None and model is None:
            raise ValueError("device_map_fn needs weights= (or model=) and num_workers=.")
        if params_map is not None:
            self._params_map = {int(k): weights_of(v) for k, v in params_map.items()}
            num_workers = num_workers or len(self._params_map)
            self.per_worker_weights = True
        self._explicit_weights = weights
        if num_workers is None and context is None and devices is not None:
            num_workers = len(devices)
        if num_workers is None and context is None:
            raise ValueError("init_on_sender needs num_workers= (or devices=, params_map=, or a collector context).")
        if device_map_fn is not None:
            devices = [device_map_fn(i) for i in range(num_workers)]
        super().init_on_sender(model_id=model_id, context=context, model=model, num_workers=num_workers,
                               devices=devices, ctx=ctx, **kwargs)

    def _make_sender(self, links: SharedMemLinks | None, *, devices=None, ctx=None, **kwargs) -> SharedMemWeightSender:
        if kwargs:
            raise TypeError(f"Unexpected init_on_sender arguments {sorted(kwargs)}")
        if links is not None and not isinstance(links, SharedMemLinks):
            raise RuntimeError(f"{type(self).__name__} moves weights through this machine's shared memory: its "
                               f"collector's workers are elsewhere ({type(links).__name__}).")
        count = self._num_workers
        if count is None:
            raise ValueError("The number of workers is unknown (give num_workers=).")
        if devices is None and links is not None:
            devices = links.devices
        ctx = ctx or (links.ctx if links is not None else None) or mp_context()
        return SharedMemWeightSender(count, ctx, [torch.device(d) if d is not None else None for d in devices]
                                     if devices is not None else None, per_worker=self.per_worker_weights,
                                     via_pipe=self._via_pipe, liveness=links.liveness if links is not None else None,
                                     device_source=links.devices if links is not None else None)

    def _initial_payload(self, weights: Any):
        if weights is not None:
            return self.prepare_weights(weights, self._model_id, self._strategy, self.context)
        if self._params_map is not None:
            return self._params_map
        if self._explicit_weights is not None:
            return weights_of(self._explicit_weights)
        model = self.model
        return weights_of(model) if model is not None else None

    def send(self, weights: Any = None, worker_ids=None, *, wait: bool | None = None) -> None:
        """Send as every scheme does; weights given as ``params_map`` buffers at ``init_on_sender``
        are kept up to date too (the caller may read them)."""
        super().send(weights, worker_ids, wait=wait)
        if self._params_map and self._last_payload is not None and not isinstance(self._last_payload, dict):
            with torch.no_grad():
                for buffer in {id(b): b for b in self._params_map.values()}.values():
                    if buffer is not self._last_payload:
                        buffer.update_(self._last_payload)

    def prepare_weights(self, weights, model_id, strategy, context=None):
        if weights is None and self.model is None and self._explicit_weights is not None:
            payload = weights_of(self._explicit_weights)
        else:
            payload = super().prepare_weights(weights, model_id, strategy, context)
        self._last_payload = payload
        return payload

    def _make_receiver(self, links=None) -> SharedMemWeightReceiver:
        info = self._connection_info
        if info is None:
            raise RuntimeError("This scheme was never initialised as a sender: it has no channel to receive on.")
        if self._worker_idx is None:
            raise RuntimeError("A SharedMem receiver needs its worker_idx.")
        return SharedMemWeightReceiver(info, self._worker_idx)


class MultiProcessWeightSyncScheme(SharedMemWeightSyncScheme):
    """Like :class:`SharedMemWeightSyncScheme`, but each update travels through the worker's pipe."""

    supports_per_worker_weights = False
    _via_pipe = True

    def __init__(self, strategy: str = "tensordict", sync: bool = True, timeout: float = WEIGHT_SYNC_TIMEOUT) -> None:
        super().__init__(strategy=strategy, sync=sync, per_worker_weights=False, timeout=timeout)
