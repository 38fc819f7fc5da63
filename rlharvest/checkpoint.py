"""The format of a collector's checkpoint: what ``state_dict()`` adds to TorchRL's keys (docs/checkpoints.md).

A collector's ``state_dict()`` keeps TorchRL's keys (``frames``, ``iter``, ``traj_pool``,
``policy_state_dict``, ``env_state_dict``, ``worker<i>``) and adds everything an exact resume needs
under one key, :data:`CHECKPOINT_KEY`, with a :data:`FORMAT_VERSION`. Counters, sizes and the
layout are plain ints, lists and strings; what only ``pickle`` can write (an env's state, the values
of the episode in flight, numpy's and Python's generators) is pickled *at capture time* into a
uint8 tensor, so the checkpoint is a snapshot of one moment (later steps cannot change it) and the
whole structure loads with ``torch.load(path)`` (``weights_only=True``). Unpickling those tensors
happens in ``load_state_dict``: load only checkpoints you trust, as with ``torch.load(...,
weights_only=False)``.
"""

from __future__ import annotations

import pickle
import random
import warnings
from typing import Any

import numpy as np
import torch

from ._utils import user_stacklevel
from .errors import CheckpointMismatchError, EpisodeRestartWarning

__all__ = ["CHECKPOINT_KEY", "FORMAT_VERSION", "CheckpointMismatchError", "EpisodeRestartWarning", "pack", "unpack",
           "capture_global_rng", "restore_global_rng", "check_compatible", "warn_restart"]

#: the key of rlharvest's part of a collector's state dict
CHECKPOINT_KEY = "rlharvest_resume"
#: bumped whenever the content under :data:`CHECKPOINT_KEY` changes; newer checkpoints are refused
FORMAT_VERSION = 1


def pack(value: Any) -> torch.Tensor:
    """``value`` pickled now, as a uint8 tensor (a snapshot that ``torch.save`` writes as a tensor)."""
    return torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def unpack(tensor: torch.Tensor) -> Any:
    """The value :func:`pack` pickled."""
    return pickle.loads(tensor.numpy().tobytes())


def capture_global_rng() -> dict[str, torch.Tensor]:
    """The state of this process's global generators: torch's, numpy's legacy one, Python's.

    Policies and envs draw from them (random actions, exploration noise, ``CountingEnv``'s seed), so
    an exact resume puts them back.
    """
    return {"torch": torch.get_rng_state(), "numpy": pack(np.random.get_state()), "python": pack(random.getstate())}


def restore_global_rng(state: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`capture_global_rng` captured."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(unpack(state["numpy"]))
    random.setstate(unpack(state["python"]))


def check_compatible(section: dict, layout: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint this collector cannot continue exactly.

    Args:
        section: the checkpoint's :data:`CHECKPOINT_KEY` entry.
        layout: this collector's layout (what the checkpoint's ``"layout"`` must equal).
        where: the collector (or worker) the error names.

    Raises:
        CheckpointMismatchError: naming the format versions, or every layout entry that differs.
    """
    version = section.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointMismatchError(f"{where}: the checkpoint has format version {version!r}; this rlharvest reads "
                                      f"versions up to {FORMAT_VERSION} (update rlharvest to load it).")
    saved = section.get("layout", {})
    differences = [f"{name}: checkpoint {saved.get(name)!r}, this collector {value!r}"
                   for name, value in layout.items() if saved.get(name) != value]
    differences += [f"{name}: checkpoint {saved[name]!r}, this collector has none" for name in saved if name not in layout]
    if differences:
        raise CheckpointMismatchError(f"{where}: the checkpoint was taken by a collector built with other arguments "
                                      "(build it with the same ones to resume): " + "; ".join(differences))


def warn_restart(where: str, env: str, reason: str) -> None:
    """The one warning of an env whose episode in flight restarts after a load."""
    warnings.warn(f"{where}: env {env} starts a new episode (new trajectory id) instead of continuing the one in "
                  f"flight at the checkpoint: {reason}", EpisodeRestartWarning, stacklevel=user_stacklevel())
