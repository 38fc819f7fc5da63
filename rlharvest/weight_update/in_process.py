"""A scheme for a model that lives in the sender's own process: the module of a replay buffer that a
collector with workers writes itself (``"replay_buffer.transform[0].module"``). Weights are written
into it where it is; workers have no copy, so nothing travels (docs/weights.md, "Models in the
collector's process").
"""

from __future__ import annotations

import contextlib
from typing import Any

from .schemes import WeightSyncScheme

__all__ = ["InProcessWeightSyncScheme"]


class InProcessWeightSyncScheme(WeightSyncScheme):
    """``send`` writes the weights into the model this process holds (resolved on the collector by its
    model id), under the collector's ``writing_lock``: no batch is written through half-updated
    weights, and every batch written after ``send`` returns goes through the new ones. The copies
    workers are given receive nothing.

    ``worker_ids`` are accepted and change nothing: the one model serves every worker.

    Example:
        >>> import torch
        >>> module = torch.nn.Linear(2, 2)
        >>> scheme = InProcessWeightSyncScheme()
        >>> scheme.init_on_sender(model_id="replay_buffer.transform[0].module", model=module)
        >>> scheme.connect()
        >>> scheme.send({"weight": torch.zeros(2, 2), "bias": torch.ones(2)})
        >>> module.bias.tolist()
        [1.0, 1.0]
    """

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None, *,
             wait: bool | None = None) -> None:
        """Write ``weights`` (any form ``update_policy_weights_`` accepts) into the model.

        Raises:
            RuntimeError: when not a connected sender.
            ValueError: when the model cannot be found in this process.
        """
        self._check_connected_sender()
        model = self.model
        if model is None:
            raise ValueError(f"{self._model_id!r} names nothing in this process: no model to write the weights into.")
        context = self.context
        payload = self.prepare_weights(weights, self._model_id, self._strategy, context)
        lock = getattr(context, "writing_lock", None)  # a context of the user's own may have none
        with lock if lock is not None else contextlib.nullcontext():  # no batch is written half-updated
            self._strategy.apply_weights(model, payload)
        self._version += 1
