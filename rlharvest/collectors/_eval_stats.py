"""How sure is an evaluation? Percentile-bootstrap intervals of a statistic of per-episode results,
and paired comparisons of two policies evaluated on the same seeds (docs/evaluation.md).

Both functions take what :meth:`~rlharvest.collectors.Evaluator.evaluate_episodes` returns
(``episodes["episode_reward"]``), or any tensor of samples, and draw the resamples as TorchRL's
functions of the same names do: with the same ``generator`` state, the same intervals.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from tensordict import TensorDict

from .._utils import positive_int

__all__ = ["bootstrap_estimate", "paired_comparison", "STATISTICS"]


def _interquartile_mean(samples: torch.Tensor) -> torch.Tensor:
    """The mean of the middle half: the lowest and highest quarter (rounded down) are dropped."""
    count = samples.shape[-1]
    dropped = int(0.25 * count)
    return samples.sort(dim=-1).values[..., dropped:count - dropped].mean(-1)


#: the statistics, each reducing the last dimension
STATISTICS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": lambda samples: samples.mean(-1),
    "median": lambda samples: samples.quantile(0.5, dim=-1),
    "iqm": _interquartile_mean,
}


def _check_arguments(values: torch.Tensor, dim: int, statistic: str, confidence: float, num_resamples: int) -> None:
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor of samples, got {type(values).__name__}.")
    if statistic not in STATISTICS:
        raise ValueError(f"Unknown statistic {statistic!r}: choose one of {', '.join(map(repr, STATISTICS))}.")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1 \
            or math.isnan(confidence):
        raise ValueError(f"confidence must be a number in (0, 1), got {confidence!r}.")
    positive_int("num_resamples", num_resamples)
    if values.ndim == 0:
        raise ValueError("values has no dimension to hold samples (a 0-d tensor): pass at least one sample along "
                         "`dim`.")
    if not -values.ndim <= dim < values.ndim:
        raise ValueError(f"dim={dim} is out of range for values of shape {tuple(values.shape)}.")
    if values.shape[dim] == 0:
        raise ValueError(f"values has no sample along dim={dim} (shape {tuple(values.shape)}).")


def bootstrap_estimate(values: torch.Tensor, dim: int = -1, *, statistic: str = "iqm", confidence: float = 0.95,
                       num_resamples: int = 1000, generator: torch.Generator | None = None) -> TensorDict:
    """A statistic of ``values`` along ``dim``, with a percentile-bootstrap confidence interval.

    Each of the ``num_resamples`` resamples draws as many samples as there are, with replacement;
    the interval holds the central ``confidence`` share of the statistic over the resamples.

    Args:
        values: the samples (e.g. per-episode returns), along ``dim``; other dimensions are kept
            (one estimate per entry, e.g. per policy).
        dim: the dimension of the samples.

    Keyword Args:
        statistic: ``"mean"``, ``"median"`` or ``"iqm"`` (the interquartile mean: the mean once the
            lowest and highest quarters are dropped, robust to a few outlying episodes).
        confidence: the interval's coverage, in (0, 1).
        num_resamples: how many bootstrap resamples.
        generator: draws the resamples (a seeded one makes the interval reproducible).

    Returns:
        a TensorDict with ``"estimate"``, ``"ci_low"`` and ``"ci_high"`` (float, of the default
        dtype), whose batch size is the shape of ``values`` without ``dim``.

    Raises:
        ValueError: for an unknown ``statistic``, a ``confidence`` outside (0, 1), a non-positive
            ``num_resamples``, a ``dim`` out of range, or no sample along it.
        TypeError: when ``values`` is not a tensor.

    Example:
        >>> returns = torch.tensor([[1.0, 1.0, 1.0, 50.0], [3.0, 3.0, 3.0, 3.0]])
        >>> summary = bootstrap_estimate(returns, statistic="iqm", generator=torch.Generator().manual_seed(0))
        >>> summary["estimate"].tolist(), summary["ci_low"][1].item(), summary["ci_high"][1].item()
        ([1.0, 3.0], 3.0, 3.0)
    """
    _check_arguments(values, dim, statistic, confidence, num_resamples)
    reduce = STATISTICS[statistic]
    samples = values.movedim(dim, -1).to(torch.get_default_dtype())
    count = samples.shape[-1]
    draw_device = generator.device if generator is not None else samples.device
    picks = torch.randint(count, (num_resamples, count), generator=generator, device=draw_device).to(samples.device)
    tail = (1 - confidence) / 2
    levels = torch.tensor([tail, 1 - tail], dtype=samples.dtype, device=samples.device)
    low, high = reduce(samples[..., picks]).quantile(levels, dim=-1)
    return TensorDict(estimate=reduce(samples), ci_low=low, ci_high=high, batch_size=samples.shape[:-1])


def paired_comparison(first: torch.Tensor, second: torch.Tensor, dim: int = -1, *, statistic: str = "mean",
                      confidence: float = 0.95, num_resamples: int = 1000,
                      generator: torch.Generator | None = None) -> TensorDict:
    """How much ``first`` beats ``second``, sample by sample: a bootstrap of their differences.

    Sample ``i`` of both must come from the same conditions, e.g. the same episode start, as two
    :meth:`~rlharvest.collectors.Evaluator.evaluate_episodes` calls with the same ``seed`` give.

    Args:
        first: the samples of the first candidate.
        second: those of the second, of the same shape.
        dim: the dimension of the samples.

    Keyword Args:
        statistic, confidence, num_resamples, generator: as :func:`bootstrap_estimate`, over
            ``first - second`` (``statistic`` defaults to ``"mean"`` here).

    Returns:
        :func:`bootstrap_estimate` of ``first - second``, with ``"probability_of_improvement"``: the
        share of pairs where ``first`` is larger, a tie counting one half.

    Raises:
        ValueError: when the shapes differ, and as :func:`bootstrap_estimate`.

    Example:
        >>> new, old = torch.tensor([3.0, 5.0, 4.0, 6.0]), torch.tensor([2.0, 5.0, 3.0, 5.0])
        >>> result = paired_comparison(new, old)
        >>> result["estimate"].item(), result["probability_of_improvement"].item()
        (0.75, 0.875)
    """
    if not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor):
        raise TypeError(f"first and second must be tensors, got {type(first).__name__} and {type(second).__name__}.")
    if first.shape != second.shape:
        raise ValueError(f"first and second must have the same shape (paired samples), got {tuple(first.shape)} "
                         f"and {tuple(second.shape)}.")
    result = bootstrap_estimate(first - second, dim, statistic=statistic, confidence=confidence,
                                num_resamples=num_resamples, generator=generator)
    dtype = result["estimate"].dtype
    wins = (first > second).to(dtype) + (first == second).to(dtype) / 2
    result["probability_of_improvement"] = wins.mean(dim)
    return result
