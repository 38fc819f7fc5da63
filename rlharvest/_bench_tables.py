"""The tables of ``rlharvest bench`` for the batched suite ("Many envs, one batched policy")."""

from __future__ import annotations

from typing import Any

__all__ = ["batched_tables"]

_KIND_LABELS = {
    "raw_vector": "raw AsyncVectorEnv + MLP (limit)",
    "parallel": "Collector(ParallelEnv)",
    "serial": "Collector(SerialEnv)",
    "asyncbatched": "AsyncBatchedCollector",
    "asyncbatched_auto": "AsyncBatched, transport=auto",
    "asyncbatched_epw4": "AsyncBatched, envs_per_worker=4",
    "multisync": "MultiSync, per-worker inference",
    "vectorenv": "Collector(GymEnv(AsyncVectorEnv))",
    "parallel_transformed": "Collector(ParallelEnv(TransformedEnv))",
}
_SIZES = {"small": "4-64-64-2 MLP", "big": "4-512-512-512-2 MLP"}
_SIDES = (("rlharvest", "rlharvest"), ("torchrl", "torchrl 0.12"), ("torchrl14", "torchrl 0.14"))


def _parse(name: str) -> tuple[str, int, str] | None:
    if not name.startswith("batched_"):
        return None
    head, _, size = name.removeprefix("batched_").rpartition("_")
    kind, _, count = head.rpartition("_")
    return (kind, int(count), size) if count.isdigit() and kind in _KIND_LABELS else None


def _rate(report: dict, side: str, kind: str, count: int, size: str) -> float | None:
    row = (report.get(side) or {}).get(f"batched_{kind}_{count}_{size}", {})
    value = row.get("frames_per_s")
    return value if isinstance(value, (int, float)) and "error" not in row else None


def _fmt(value: float | None) -> str:
    return f"{value:,.0f}" if value is not None else "-"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def batched_tables(report: dict[str, Any]) -> list[str]:
    """Frames/s of the batched workloads: the 8-env tables (one per MLP) and the scaling table."""
    parsed = [p for p in map(_parse, report["workloads"]) if p is not None]
    if not parsed:
        return []
    lines: list[str] = []
    main = sorted({count for kind, count, _ in parsed if kind in ("multisync", "vectorenv")} or {8})
    for count in main:
        for size in [name for name in _SIZES if any(p[1] == count and p[2] == name for p in parsed)]:
            lines += ["", f"many envs, one batched policy: {count} CartPole-v1, {_SIZES[size]} "
                          "(frames/s, ratio to the side's raw loop)",
                      f"{'collector':40s} " + " ".join(f"{label:>13s} {'/raw':>6s}" for _, label in _SIDES)
                      + f" {'rlh/0.12':>9s} {'rlh/0.14':>9s}"]
            for kind in _KIND_LABELS:
                if not any(p == (kind, count, size) for p in parsed):
                    continue
                rates = {side: _rate(report, side, kind, count, size) for side, _ in _SIDES}
                raw = {side: _rate(report, side, "raw_vector", count, size) for side, _ in _SIDES}
                cells = " ".join(f"{_fmt(rates[side]):>13s} {_ratio(rates[side], raw[side]):>6s}" for side, _ in _SIDES)
                lines.append(f"{_KIND_LABELS[kind]:40s} {cells} {_ratio(rates['rlharvest'], rates['torchrl']):>9s} "
                             f"{_ratio(rates['rlharvest'], rates['torchrl14']):>9s}")
            multisync = _rate(report, "rlharvest", "multisync", count, size)
            if multisync:
                batched = [f"{_KIND_LABELS[k]} {_ratio(_rate(report, 'rlharvest', k, count, size), multisync)}"
                           for k in ("parallel", "asyncbatched", "asyncbatched_epw4")
                           if _rate(report, "rlharvest", k, count, size)]
                lines.append(f"rlharvest's batched inference over its MultiSync: {', '.join(batched)}")
    counts = sorted({count for kind, count, size in parsed if size == "small" and kind == "parallel"})
    if len(counts) > 1:
        columns = [("rlharvest", "raw_vector", "raw"), ("rlharvest", "parallel", "rlh PEnv"),
                   ("torchrl", "parallel", "trl12 PEnv"), ("torchrl14", "parallel", "trl14 PEnv"),
                   ("rlharvest", "asyncbatched", "rlh ABC"), ("torchrl14", "asyncbatched", "trl14 ABC"),
                   ("torchrl14", "asyncbatched_auto", "trl14 ABC auto")]
        lines += ["", "scaling, 4-64-64-2 MLP (frames/s; PEnv = Collector(ParallelEnv(n)), "
                      "ABC = AsyncBatchedCollector)",
                  f"{'envs':>5s} " + " ".join(f"{label:>14s}" for _, _, label in columns)]
        for count in counts:
            lines.append(f"{count:5d} " + " ".join(f"{_fmt(_rate(report, side, kind, count, 'small')):>14s}"
                                                   for side, kind, _ in columns))
    return lines
