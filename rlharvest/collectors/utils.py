"""Batch utilities: regrouping a batch per trajectory."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from .._utils import NestedKey

__all__ = ["split_trajectories"]


def split_trajectories(
    rollout_tensordict: TensorDictBase,
    *,
    prefix=None,
    trajectory_key: NestedKey | None = None,
    done_key: NestedKey | None = None,
    as_nested: bool = False,
) -> TensorDictBase:
    """Regroup a batch of shape ``(*B, T)`` into one zero-padded row per trajectory.

    Rows are ordered by sub-env, then time; ``("collector", "mask")`` marks real steps. When every
    row of the batch already holds exactly one trajectory, the data is returned unpadded (with an
    all-True mask; a 1-D batch gains a leading dim of 1). Steps with trajectory id -1 (not collected)
    are dropped.

    Args:
        rollout_tensordict: the batch.
        prefix: where the collector entries live (default ``"collector"``).
        trajectory_key: key of the trajectory ids (default ``(prefix, "traj_ids")``).
        done_key: unused; accepted for TorchRL compatibility (ids already mark trajectories).
        as_nested: unsupported (raises ``NotImplementedError``); kept for signature compatibility.

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"obs": torch.arange(5.), ("collector", "traj_ids"): torch.tensor([0, 0, 1, 1, 1])},
        ...                 batch_size=[5])
        >>> out = split_trajectories(td)
        >>> out["obs"].tolist(), out["collector", "mask"].tolist()
        ([[0.0, 1.0, 0.0], [2.0, 3.0, 4.0]], [[True, True, False], [True, True, True]])
    """
    if as_nested:
        raise NotImplementedError("split_trajectories(as_nested=True) is not supported.")
    prefix = prefix or "collector"
    traj_key = trajectory_key or (prefix, "traj_ids")
    mask_key = (prefix, "mask")
    batch = rollout_tensordict
    time_steps = batch.shape[-1] if batch.batch_dims else 1
    rows = batch.reshape(-1, time_steps)
    ids = rows.get(traj_key)
    if bool((ids[:, :1] == ids).all()) and bool((ids != -1).all()):
        out = rows.clone(False) if batch.batch_dims > 1 else rows
        out.set(mask_key, torch.ones(ids.shape, dtype=torch.bool, device=ids.device))
        return _name_time(out)
    flat = rows.reshape(-1)
    flat_ids = flat.get(traj_key)
    valid = flat_ids != -1
    row_index = torch.arange(rows.shape[0], device=flat_ids.device).repeat_interleave(time_steps)
    # A new segment starts at each row start and wherever the id changes within a row.
    starts = torch.ones_like(flat_ids, dtype=torch.bool)
    starts[1:] = (flat_ids[1:] != flat_ids[:-1]) | (row_index[1:] != row_index[:-1])
    starts &= valid
    flat, starts, flat_ids = flat[valid], starts[valid], flat_ids[valid]
    segment = torch.cumsum(starts.long(), 0) - 1
    positions = torch.arange(flat.shape[0], device=flat_ids.device)
    first = torch.zeros(int(segment.max()) + 1 if len(segment) else 0, dtype=torch.long, device=flat_ids.device)
    first.scatter_reduce_(0, segment, positions, reduce="amin", include_self=False)
    position = positions - first[segment]
    num_segments, max_len = first.shape[0], int(position.max()) + 1 if len(position) else 0

    def scatter(leaf: torch.Tensor) -> torch.Tensor:
        out = leaf.new_zeros((num_segments, max_len, *leaf.shape[1:]))
        out[segment, position] = leaf
        return out

    out = flat.apply(scatter, batch_size=[num_segments, max_len])
    mask = torch.zeros((num_segments, max_len), dtype=torch.bool, device=flat_ids.device)
    mask[segment, position] = True
    out.set(mask_key, mask)
    return _name_time(out)


def _name_time(td: TensorDictBase) -> TensorDictBase:
    try:
        td.names = [None] * (td.batch_dims - 1) + ["time"]
    except Exception:  # names are cosmetic; some TensorDict types refuse them
        pass
    return td
