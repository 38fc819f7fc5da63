"""TorchRL reference side of the rlharvest collector benchmarks.

Run inside the TorchRL venv (``benchmarks/setup_torchrl_venv.sh``)::

    .venv-torchrl/bin/python benchmarks/torchrl_side.py --workload collector_cartpole
    .venv-torchrl/bin/python benchmarks/torchrl_side.py --workload all --json \\
        --output benchmarks/results/torchrl-0.12.0.json

Each workload prints one JSON object to stdout (``--json``: one compact line;
otherwise indented).  ``--workload all`` runs every workload in a fresh
subprocess of this script with a timeout, waiting for a quiet machine first,
and reports a failure as ``{"workload": ..., "error": ...}``.  ``--list``
prints the names.  Workloads are defined in ``common.py``, measured by
``measure.py``; this file only maps them onto TorchRL's collectors.

Threads: ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` are set when
this module is imported, which also happens in TorchRL's spawned workers
(they re-import the main module as ``__mp_main__``).
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

import common  # noqa: E402
import harness  # noqa: E402
import measure  # noqa: E402


class TorchRLSide:
    """:class:`measure.Side` for TorchRL 0.12 (imports torchrl lazily)."""

    name = "torchrl"

    def versions(self) -> dict[str, str]:
        import tensordict
        import torchrl

        return {
            "torchrl": torchrl.__version__,
            "tensordict": tensordict.__version__,
            "torch": torch.__version__,
        }

    def build_collector(
        self, kind: str, env_fn: Callable[[], Any], policy: torch.nn.Module, frames_per_batch: int
    ) -> Any:
        """Collector / MultiSyncCollector / MultiAsyncCollector /
        DistributedCollector / RPCCollector, 2 workers, default options."""
        from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

        kwargs = {"frames_per_batch": frames_per_batch, "total_frames": common.TOTAL_FRAMES}
        env_fns = [env_fn] * common.NUM_WORKERS
        if kind == "single":
            return Collector(env_fn, policy, **kwargs)
        if kind == "multisync":
            return MultiSyncCollector(env_fns, policy, **kwargs)
        if kind == "multiasync":
            return MultiAsyncCollector(env_fns, policy, **kwargs)
        if kind.startswith("ray_"):
            from torchrl.collectors.distributed import RayCollector

            return RayCollector(env_fns, policy, sync=kind == "ray_sync", **kwargs)
        if kind.startswith(("distributed_", "rpc_")):
            return self._remote_collector(kind, env_fns, policy, kwargs)
        raise ValueError(f"unknown collector kind {kind!r}")

    @staticmethod
    def _remote_collector(
        kind: str, env_fns: list[Callable[[], Any]], policy: torch.nn.Module, kwargs: dict
    ) -> Any:
        """DistributedCollector / RPCCollector: launcher "mp", gloo, free ports.

        Both use ``tcp_port`` (process group / RPC) and ``tcp_port + 1``
        (command store); DistributedCollector's weight-sync scheme adds
        ``tcp_port + 2``, so a block of three free ports is picked.
        """
        from torchrl.collectors.distributed import DistributedCollector, RPCCollector

        family, mode = kind.split("_")
        cls = DistributedCollector if family == "distributed" else RPCCollector
        return cls(
            env_fns,
            policy,
            launcher="mp",
            backend="gloo",
            tcp_port=common.find_free_port_block(3),
            sync=mode == "sync",
            **kwargs,
        )

    def build_batched_collector(self, kind: str, num_envs: int, size: str, frames_per_batch: int) -> Any:
        """TorchRL's Collector(ParallelEnv), AsyncBatchedCollector (0.14) and MultiSyncCollector."""
        import functools

        import torchrl_envs as envs
        from torchrl.collectors import Collector, MultiSyncCollector
        from torchrl.envs import ParallelEnv, SerialEnv

        kwargs = {"frames_per_batch": frames_per_batch, "total_frames": common.TOTAL_FRAMES}
        make = envs.make_cartpole_env
        if kind in ("parallel", "parallel_transformed", "serial"):
            env_fn = envs.make_transformed_cartpole if kind == "parallel_transformed" else make
            batched = SerialEnv if kind == "serial" else ParallelEnv
            return Collector(batched(num_envs, env_fn), envs.batched_policy(size), **kwargs)
        if kind == "multisync":
            return MultiSyncCollector([make] * num_envs, envs.batched_policy(size), **kwargs)
        if kind in ("asyncbatched", "asyncbatched_auto", "asyncbatched_epw4"):
            import torchrl

            if tuple(int(part) for part in torchrl.__version__.split(".")[:2]) < (0, 14):
                # 0.12 has an experimental one with another signature; the issue compares with 0.14's
                raise NotImplementedError(
                    f"the AsyncBatchedCollector measured is TorchRL 0.14's, not {torchrl.__version__}'s")
            from torchrl.collectors import AsyncBatchedCollector

            if kind == "asyncbatched":  # the default policy transport, named to avoid its FutureWarning
                policy = {"policy": envs.batched_policy(size), "transport": "driver"}
            elif kind == "asyncbatched_epw4":  # grouped workers take the driver transport
                policy = {"policy": envs.batched_policy(size), "transport": "driver", "envs_per_worker": 4}
            else:  # TorchRL's fastest set-up: a policy process the env workers reach directly
                policy = {"policy_factory": functools.partial(envs.batched_policy, size), "transport": "auto"}
            return AsyncBatchedCollector([make] * num_envs, env_backend="multiprocessing", **policy, **kwargs)
        raise NotImplementedError(f"no TorchRL collector for the batched kind {kind!r}")

    def env_fn(self, family: str) -> Callable[[], Any]:
        import torchrl_envs

        return torchrl_envs.ENV_FNS[family]

    def policy(self, family: str) -> torch.nn.Module:
        import torchrl_envs

        return torchrl_envs.POLICY_FNS[family]()

    def big_policy(self, n_params: int) -> torch.nn.Module:
        import torchrl_envs

        return torchrl_envs.big_policy(n_params)

    def marked_policy(self) -> tuple[common.MarkedCartpolePolicy, torch.nn.Module]:
        import torchrl_envs

        return torchrl_envs.marked_policy()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    side = TorchRLSide()
    return harness.cli(
        argv,
        script=Path(__file__).resolve(),
        names=common.workload_names(),
        run_one=lambda name, quick: measure.run_one(side, name, quick),
        description="TorchRL side of the rlharvest collector benchmarks",
    )


if __name__ == "__main__":
    sys.exit(main())
