"""rlharvest side of the collector benchmarks (mirror of ``torchrl_side.py``).

Run with the project's venv::

    .venv/bin/python benchmarks/rlharvest_side.py --workload collector_cartpole
    .venv/bin/python benchmarks/rlharvest_side.py --workload all --json --output benchmarks/results/local-rlharvest.json

``rlharvest bench`` drives this script (and ``torchrl_side.py`` in the TorchRL side venv) and prints
one table. Workloads are defined in ``common.py`` and measured by ``measure.py``, identically for both
sides; this file only maps them onto rlharvest's collectors.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This checkout's rlharvest, also when another Python runs this side (the TorchRL 0.14 venv, for the
# workloads with TorchRL env factories).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import harness  # noqa: E402
import measure  # noqa: E402


class RLHarvestSide:
    """:class:`measure.Side` for rlharvest."""

    name = "rlharvest"

    def versions(self) -> dict[str, str]:
        import tensordict

        import rlharvest

        return {"rlharvest": rlharvest.__version__, "tensordict": tensordict.__version__, "torch": torch.__version__}

    def build_collector(self, kind: str, env_fn: Callable[[], Any], policy: torch.nn.Module,
                        frames_per_batch: int) -> Any:
        """Collector / MultiSync / MultiAsync / Distributed / RPC, 2 workers, default options."""
        from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
        from rlharvest.collectors.distributed import DistributedCollector, RPCCollector

        kwargs = {"frames_per_batch": frames_per_batch, "total_frames": common.TOTAL_FRAMES}
        env_fns = [env_fn] * common.NUM_WORKERS
        if kind == "single":
            return Collector(env_fn, policy, **kwargs)
        if kind == "multisync":
            return MultiSyncCollector(env_fns, policy, **kwargs)
        if kind == "multiasync":
            return MultiAsyncCollector(env_fns, policy, **kwargs)
        family, _, mode = kind.partition("_")
        if family in ("distributed", "rpc"):
            cls = DistributedCollector if family == "distributed" else RPCCollector
            return cls(env_fns, policy, launcher="mp", backend="gloo", tcp_port=common.find_free_port_block(3),
                       sync=mode == "sync", **kwargs)
        if family == "ray":
            from rlharvest.collectors.distributed import RayCollector

            return RayCollector(env_fns, policy, sync=mode == "sync", **kwargs)
        raise ValueError(f"unknown collector kind {kind!r}")

    def build_batched_collector(self, kind: str, num_envs: int, size: str, frames_per_batch: int) -> Any:
        """ParallelEnv / AsyncBatched / MultiSync / vector-env collectors over ``num_envs`` CartPole envs."""
        import functools

        import rlharvest_envs as envs

        from rlharvest.collectors import AsyncBatchedCollector, Collector, MultiSyncCollector
        from rlharvest.envs import ParallelEnv, SerialEnv

        kwargs = {"frames_per_batch": frames_per_batch, "total_frames": common.TOTAL_FRAMES}
        make = envs.make_cartpole_env
        if kind in ("parallel", "serial"):
            batched = ParallelEnv if kind == "parallel" else SerialEnv
            return Collector(batched(num_envs, make), envs.batched_policy(size), **kwargs)
        if kind == "parallel_transformed":
            import torchrl_envs  # TorchRL's env factories: this side then runs with a Python that has torchrl

            return Collector(ParallelEnv(num_envs, torchrl_envs.make_transformed_cartpole), envs.batched_policy(size),
                             **kwargs)
        if kind == "asyncbatched":
            return AsyncBatchedCollector([make] * num_envs, policy=envs.batched_policy(size),
                                         env_backend="multiprocessing", **kwargs)
        if kind == "asyncbatched_epw4":
            return AsyncBatchedCollector([make] * num_envs, policy=envs.batched_policy(size), envs_per_worker=4,
                                         env_backend="multiprocessing", **kwargs)
        if kind == "asyncbatched_auto":
            return AsyncBatchedCollector([make] * num_envs, policy_factory=functools.partial(envs.batched_policy, size),
                                         transport="auto", env_backend="multiprocessing", **kwargs)
        if kind == "multisync":
            return MultiSyncCollector([make] * num_envs, envs.batched_policy(size), **kwargs)
        if kind == "vectorenv":
            return Collector(envs.make_vector_cartpole(num_envs), envs.batched_policy(size), **kwargs)
        raise ValueError(f"unknown batched collector kind {kind!r}")

    def env_fn(self, family: str) -> Callable[[], Any]:
        import rlharvest_envs

        return rlharvest_envs.ENV_FNS[family]

    def policy(self, family: str) -> torch.nn.Module:
        import rlharvest_envs

        return rlharvest_envs.POLICY_FNS[family]()

    def big_policy(self, n_params: int) -> torch.nn.Module:
        import rlharvest_envs

        return rlharvest_envs.big_policy(n_params)

    def marked_policy(self):
        import rlharvest_envs

        return rlharvest_envs.marked_policy()


def main(argv: list[str] | None = None) -> int:
    side = RLHarvestSide()
    return harness.cli(argv, script=Path(__file__).resolve(), names=common.workload_names(),
                       run_one=lambda name, quick: measure.run_one(side, name, quick),
                       description="rlharvest side of the collector benchmarks")


if __name__ == "__main__":
    sys.exit(main())
