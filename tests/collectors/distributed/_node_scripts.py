"""Code that runs outside the pytest process, for test_slurm.py and test_two_hosts.py.

* :func:`delayed_main` is the main function of the SLURM job submitted by
  ``submitit_delayed_launcher`` (submitit pickles it by reference: the job imports this module,
  so ``tests/collectors/distributed`` must be on the job's ``PYTHONPATH``).
* ``python _node_scripts.py loopback-listeners`` (test_security.py, run in a network namespace
  whose host name resolves to a routable address) prints, as JSON, the addresses every process
  of an ``"mp"`` DistributedCollector and RPCCollector listens on.
* ``python _node_scripts.py two-hosts-main --port P --mode happy|cut`` is the main process of the
  two-host test, run inside network namespace A. It prints one JSON object per line on stdout
  (flushed), which the test reads as it goes; in ``happy`` mode it waits for a line on stdin
  before shutting down (so the test can inspect the live connections).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

SLURM_TEST_CONF = {"slurm_cpus_per_task": 1, "slurm_gpus_per_node": 0, "timeout_min": 5}


# ---------------------------------------------------------------- env constructors that fail on a node
def raising_env():
    raise ValueError("env constructor exploded on the node")


def exiting_env():
    os._exit(7)  # the node's process dies without a word


# ---------------------------------------------------------------- submitit_delayed_launcher main job
def delayed_main(tcp_port: int, frames_per_batch: int, batches: int, framework: str = "distributed") -> dict:
    """Collect ``batches`` batches from 2 nodes started by submitit_delayed_launcher."""
    from rlharvest.collectors.distributed import DistributedCollector, RPCCollector
    from rlharvest.envs import ContinuousMockEnv

    kwargs = dict(frames_per_batch=frames_per_batch, total_frames=frames_per_batch * batches,
                  launcher="submitit_delayed", tcp_port=tcp_port, sync=True)
    if framework == "rpc":
        collector = RPCCollector([ContinuousMockEnv] * 2, **kwargs)
    else:
        collector = DistributedCollector([ContinuousMockEnv] * 2, worker_timeout=120.0, **kwargs)
    try:
        shapes, names, ids = [], [], []
        for batch in collector:
            shapes.append(tuple(batch.shape))
            names.append(list(batch.names))
            traj = batch["collector", "traj_ids"]
            ids.append([sorted(set(traj[node].tolist())) for node in range(traj.shape[0])])
    finally:
        collector.shutdown()
    return {"shapes": shapes, "names": names, "traj_ids": ids, "job_id": os.environ.get("SLURM_JOB_ID"),
            "host": socket.gethostname()}


# ---------------------------------------------------------------- two-host main process
def _emit(**fields) -> None:
    fields.setdefault("t", time.monotonic())
    print(json.dumps(fields), flush=True)


def _make_env():
    from rlharvest.envs import CountingEnv

    return CountingEnv(max_steps=4)


def two_hosts_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=["happy", "cut"], required=True)
    parser.add_argument("--frames-per-batch", type=int, default=20)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    args = parser.parse_args(argv)

    import torch
    from mocks import CountingPolicy

    from rlharvest import WorkerError
    from rlharvest.collectors.distributed import DistributedCollector

    torch.set_num_threads(1)
    policy = CountingPolicy(1.0)
    _emit(event="starting", hostname_ip=socket.gethostbyname(socket.gethostname()), pid=os.getpid())
    collector = DistributedCollector([_make_env], policy, launcher="submitit_delayed", tcp_port=args.port,
                                     heartbeat_timeout=args.heartbeat_timeout, frames_per_batch=args.frames_per_batch,
                                     total_frames=-1, worker_timeout=60.0)
    _emit(event="started", advertised=collector._net.advertised_host)
    code = 0
    updated_at = None
    try:
        for i, batch in enumerate(collector):
            actions = sorted(set(batch["action"].flatten().tolist()))
            _emit(event="batch", i=i, shape=list(batch.shape), names=list(batch.names),
                  traj_ids=sorted(set(batch["collector", "traj_ids"].flatten().tolist())), actions=actions)
            if i == 1:
                with torch.no_grad():
                    policy.weight.fill_(2.0)
                collector.update_policy_weights_()
                updated_at = i
                _emit(event="updated")
            if args.mode == "happy" and i >= 5:
                # hold the connections open until the test has looked at them (it writes a line)
                _emit(event="holding")
                sys.stdin.readline()
                break
            if args.mode == "cut" and updated_at is not None and i > updated_at + 2:
                if i == updated_at + 3:
                    _emit(event="cut-me")
                time.sleep(0.1)  # keep iterating, gently (the machine is shared)
    except WorkerError as err:
        _emit(event="worker-error", worker_idx=err.worker_idx, type=type(err).__name__, message=str(err))
        code = 3
    finally:
        start = time.monotonic()
        collector.shutdown()
        _emit(event="shutdown", seconds=time.monotonic() - start)
    return code


# ---------------------------------------------------------------- listening addresses of "mp" collectors
def listening_addresses(pids: list[int]) -> dict:
    import psutil

    return {str(pid): sorted({c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"})
            for pid in pids}


def loopback_listeners() -> int:
    import torch
    from mocks import CountingPolicy

    from rlharvest.collectors.distributed import DistributedCollector, RPCCollector
    from rlharvest.transport.ports import free_port_block

    torch.set_num_threads(1)
    result = {"hostname_ip": socket.gethostbyname(socket.gethostname()),
              "env": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")}}
    for name, cls in (("distributed", DistributedCollector), ("rpc", RPCCollector)):
        collector = cls([_make_env] * 2, CountingPolicy(1.0), launcher="mp", tcp_port=free_port_block(3),
                        frames_per_batch=4, total_frames=-1)
        try:
            collector.next()
            pids = [os.getpid()] + [node.process.pid for node in collector._launched]
            result[name] = listening_addresses(pids)
        finally:
            collector.shutdown()
    _emit(event="listeners", **result)
    return 0


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "two-hosts-main":
        sys.exit(two_hosts_main(rest))
    if command == "loopback-listeners":
        sys.exit(loopback_listeners())
    raise SystemExit(f"unknown command {command!r}")
