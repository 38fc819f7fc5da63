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
* ``python _node_scripts.py join-main --port P --host-ip A`` is the main process of the two-host join
  test: ``launcher="external"`` with two slots; it prints its ``join_command()``, then one event per
  batch, and stops a few batches after a node left (SIGTERM).
* ``python _node_scripts.py two-hosts-restart-main --port P --host-ip A --node-netns NS --node-ifname IF``
  is the main process of the link-cut test: ``launcher="mp"`` nodes, node 1 moved into namespace
  ``NS`` (host B) when first launched, so its traffic crosses the veth pair; its replacement starts
  on host A, beside the main process.
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
    from rlharvest.collectors.engine import engine_of

    _emit(event="started", advertised=engine_of(collector).options.network.advertised_host)
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


def join_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host-ip", required=True)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    args = parser.parse_args(argv)

    import torch
    from mocks import CountingPolicy

    from rlharvest.collectors.distributed import DistributedCollector

    torch.set_num_threads(1)
    collector = DistributedCollector([_make_env] * 2, CountingPolicy(1.0), launcher="external", tcp_port=args.port,
                                     bind_address=args.host_ip, heartbeat_timeout=args.heartbeat_timeout,
                                     frames_per_batch=8, total_frames=-1, worker_timeout=90.0, sync=False,
                                     preemption_grace=2.0)
    _emit(event="join", argv=collector.join_command())
    after_leave = 0
    try:
        for i, batch in enumerate(collector):
            _emit(event="batch", i=i, shape=list(batch.shape),
                  traj_ids=sorted(set(batch["collector", "traj_ids"].flatten().tolist())))
            if i == 3:
                _emit(event="sigterm-me")
            if i >= 3 and collector.stats()["preemptions"]:
                after_leave += 1
                if after_leave == 3:
                    stats = collector.stats()
                    _emit(event="left", active=collector.active_workers, restarts=stats["restarts"],
                          preemptions=stats["preemptions"], workers=stats["workers"])
                    break
            time.sleep(0.05)  # keep iterating, gently (the machine is shared)
    finally:
        collector.shutdown()
        _emit(event="shutdown")
    return 0


# ---------------------------------------------------------------- two-host restart (link cut)
def _echo_weight_policy(weight: float):
    """action = 1 (CountingEnv observations step by exactly 1), ``policy_weight`` = the weight."""
    import torch
    from tensordict.nn import TensorDictModule

    class EchoWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([float(weight)]))

        def forward(self, observation):
            ones = torch.ones(observation.shape, dtype=torch.float32)
            return ones, ones * self.weight

    return TensorDictModule(EchoWeight(), in_keys=["observation"], out_keys=["action", "policy_weight"])


def node_in_host_b(rank: int, *args, **kwargs) -> None:
    """Node target: the first node 1 enters host B's network namespace, then runs as any node."""
    from rlharvest.worker.nodes import node_main

    if rank == 2 and kwargs.get("command_port") is None:  # a replacement is told a command port of its own
        import ctypes

        fd = os.open(os.environ["RLH_TEST_NODE_NETNS"], os.O_RDONLY)
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "setns into host B failed")
        os.close(fd)
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = os.environ["RLH_TEST_NODE_IFNAME"]
    node_main(rank, *args, **kwargs)


def _enter_netns(path: str, ifname: str) -> None:
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), f"setns into {path} failed")
    os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = ifname


def node_in_hosts(rank: int, *args, **kwargs) -> None:
    """Node target: a first node whose rank ``$RLH_TEST_NODE_HOSTS`` lists (``rank=netns-path@ifname``,
    comma-separated) enters that network namespace, then runs as any node; replacements stay beside
    the main process (unless ``$RLH_TEST_REPLACE_IN_HOSTS`` is set: then they enter it too)."""
    from rlharvest.worker.nodes import node_main

    placement = dict(item.split("=", 1) for item in os.environ.get("RLH_TEST_NODE_HOSTS", "").split(",") if item)
    first = kwargs.get("command_port") is None  # a replacement is told a command port of its own
    if str(rank) in placement and (first or os.environ.get("RLH_TEST_REPLACE_IN_HOSTS")):
        path, ifname = placement[str(rank)].split("@")
        _enter_netns(path, ifname)
    node_main(rank, *args, **kwargs)


def _veth_collector_class(target=None):
    """A DistributedCollector whose ``"mp"`` nodes reach the main process at host A's veth address
    (not loopback) and let gloo pick the interface from GLOO_SOCKET_IFNAME, so a node in host B works."""
    import dataclasses

    from rlharvest.collectors.distributed import DistributedCollector
    from rlharvest.collectors.options.network import NetworkConfig
    from rlharvest.collectors.options.torchdist import TorchDistOptions
    from rlharvest.transport.torchdist import TorchDistBackend

    @dataclasses.dataclass(frozen=True)
    class VethNetwork(NetworkConfig):
        @property
        def device_host(self):
            return None

    @dataclasses.dataclass(frozen=True)
    class VethOptions(TorchDistOptions):
        def build_backend(self):
            return TorchDistBackend(self.num_workers, target or node_in_host_b, self.network, launcher="mp",
                                    backend=self.backend)

    class VethCollector(DistributedCollector):
        def _build(self, options, shares):
            network = VethNetwork(**{**vars(options.network), "advertised_host": options.network.bind_host})
            values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
            super()._build(VethOptions(**{**values, "network": network}), shares)

    return VethCollector


class _EmitRestarts:
    """A logging handler: each restart the collector logs becomes a ``restarting`` event."""

    level = 0

    def handle(self, record) -> None:
        _emit(event="restarting", message=record.getMessage())


def two_hosts_restart_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host-ip", required=True)
    parser.add_argument("--frames-per-batch", type=int, default=8)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    parser.add_argument("--batches-after-restart", type=int, default=6)
    args = parser.parse_args(argv)

    import logging

    import torch

    # from the module, not __main__: the replacement node starts from the forkserver, which finds
    # its target by reference and never runs this script's __main__
    from _node_scripts import _veth_collector_class

    torch.set_num_threads(1)
    logging.getLogger("rlharvest.restarts").addHandler(_EmitRestarts())
    policy = _echo_weight_policy(1.0)
    collector = _veth_collector_class()(
        [_make_env] * 2, policy, bind_address=args.host_ip, tcp_port=args.port, sync=True,
        heartbeat_timeout=args.heartbeat_timeout, frames_per_batch=args.frames_per_batch, total_frames=-1,
        worker_timeout=60.0, max_worker_restarts=1)
    _emit(event="started", pids=collector.worker_pids())
    after = None
    try:
        for i, batch in enumerate(collector):
            _emit(event="batch", i=i, shape=list(batch.shape),
                  traj_ids=batch["collector", "traj_ids"].tolist(),
                  observation=batch["observation"].squeeze(-1).tolist(),
                  weight=batch["policy_weight"].squeeze(-1).tolist(), restarts=collector.stats()["restarts"])
            if i == 1:
                with torch.no_grad():
                    policy.module.weight.fill_(5.0)
                collector.update_policy_weights_()
                _emit(event="updated")
            if i == 3:
                _emit(event="cut-me")
            if collector.stats()["restarts"] and after is None:
                after = i
            if after is not None and i >= after + args.batches_after_restart:
                break
            time.sleep(0.05)
        stats = collector.stats()
        _emit(event="stats", restarts=stats["restarts"], causes=[
            [c.worker, c.kind, c.message] for c in collector.restart_causes],
            pids=collector.worker_pids())
    finally:
        collector.shutdown()
        _emit(event="shutdown")
    return 0


# ---------------------------------------------------------------- one copy per host (weights)
def _wide_policy(params: int):
    """action = 1; ``weight_min``/``weight_max``: the extremes of a ``params``-float weight, which
    differ only while an update is half applied (every update fills the whole weight with one value)."""
    import torch
    from tensordict.nn import TensorDictModule

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(params))

        def forward(self, observation):
            ones = torch.ones(observation.shape, dtype=torch.float32)
            return ones, ones * self.weight.min(), ones * self.weight.max()

    return TensorDictModule(Wide(), in_keys=["observation"], out_keys=["action", "weight_min", "weight_max"])


def _tx_bytes(ifname: str) -> int:
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as handle:
        return int(handle.read())


def _kill_soon(pid: int, delay: float) -> None:
    """SIGSTOP ``pid`` now (it stops before it can take the next update), SIGKILL it ``delay`` s later."""
    import signal
    import threading

    os.kill(pid, signal.SIGSTOP)
    threading.Timer(delay, os.kill, args=(pid, signal.SIGKILL)).start()


def host_copies_main(argv: list[str] | None = None) -> int:
    """Main process of the one-copy-per-host test and benchmark: ``"mp"`` nodes placed in other
    hosts by ``$RLH_TEST_NODE_HOSTS``; ``--updates`` updates, each followed by one batch; prints the
    bytes that left through ``--ifname`` during each update, its seconds, and what every node ran.

    ``--kill between|during``: node ``--kill-node`` (0: its host's carrier) is killed after update 2 and
    its batch, or stopped before update 3 and killed while the main process waits for it to take the
    update."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host-ip", required=True)
    parser.add_argument("--ifname", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--params", type=int, default=250_000)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--kill", choices=["none", "between", "during"], default="none")
    parser.add_argument("--kill-node", type=int, default=0)
    parser.add_argument("--relay", action="store_true", help="DistributedWeightSyncScheme(relay=True); without it relay=False")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    parser.add_argument("--no-wait", action="store_true",
                        help="DistributedWeightSyncScheme(sync=False): updates return before the acknowledgements")
    args = parser.parse_args(argv)

    import torch

    from _node_scripts import _veth_collector_class, node_in_hosts
    from rlharvest.weight_update import DistributedWeightSyncScheme

    torch.set_num_threads(1)
    policy = _wide_policy(args.params)
    collector = _veth_collector_class(node_in_hosts)(
        [_make_env] * args.nodes, policy, bind_address=args.host_ip, tcp_port=args.port, sync=True,
        heartbeat_timeout=args.heartbeat_timeout, frames_per_batch=2 * args.nodes, total_frames=-1,
        worker_timeout=60.0, max_worker_restarts=1 if args.kill != "none" else 0, track_policy_version=True,
        weight_sync_schemes={"policy": DistributedWeightSyncScheme(sync=not args.no_wait, relay=args.relay)})
    pids = collector.worker_pids()
    _emit(event="started", pids=pids, weight_bytes=4 * args.params)
    try:
        batches = iter(collector)
        next(batches)
        for k in range(1, args.updates + 1):
            if args.kill == "during" and k == 3:
                _kill_soon(pids[args.kill_node], delay=1.0)
            with torch.no_grad():
                policy.module.weight.fill_(float(k))
            before, start = _tx_bytes(args.ifname), time.perf_counter()
            collector.update_policy_weights_()
            seconds, sent = time.perf_counter() - start, _tx_bytes(args.ifname) - before
            # the first batch may have been under way during the update (its rows: the old or the new
            # weights); the second is collected after it returned
            ran = [next(batches), next(batches)]
            _emit(event="update", k=k, seconds=seconds, tx_bytes=sent, restarts=collector.stats()["restarts"],
                  weight_min=[b["weight_min"].reshape(args.nodes, -1).tolist() for b in ran],
                  weight_max=[b["weight_max"].reshape(args.nodes, -1).tolist() for b in ran],
                  versions=[b["policy_version"].reshape(args.nodes, -1).tolist() for b in ran],
                  policy_version=collector.policy_version)
            if args.kill == "between" and k == 2:
                os.kill(pids[args.kill_node], 9)
                while collector.stats()["restarts"] == 0:  # the next batches notice it and replace it
                    next(batches)
        if args.no_wait:  # the nodes take the last update by themselves: a few batches later, all run it
            for i in range(50):
                ran = next(batches)
                if set(ran["weight_min"].flatten().tolist()) == {float(args.updates)}:
                    break
            _emit(event="settled", batches=i + 1, weight_min=ran["weight_min"].reshape(args.nodes, -1).tolist(),
                  weight_max=ran["weight_max"].reshape(args.nodes, -1).tolist())
        _emit(event="stats", restarts=collector.stats()["restarts"],
              pids=collector.worker_pids())
    finally:
        collector.shutdown()
        _emit(event="shutdown")
    return 0


# ---------------------------------------------------------------- listening addresses of "mp" collectors
def listening_addresses(pids: list[int]) -> dict:
    """The local addresses of each process's listening and connected sockets (gloo's ports close
    once their pair formed: its connections show where it runs)."""
    import psutil

    return {str(pid): sorted({c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process(pid).net_connections("inet")
                              if c.status in ("LISTEN", "ESTABLISHED")}) for pid in pids}


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
            pids = [os.getpid()] + collector.worker_pids()
            result[name] = listening_addresses(pids)
        finally:
            collector.shutdown()
    _emit(event="listeners", **result)
    return 0


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "two-hosts-main":
        sys.exit(two_hosts_main(rest))
    if command == "join-main":
        sys.exit(join_main(rest))
    if command == "two-hosts-restart-main":
        sys.exit(two_hosts_restart_main(rest))
    if command == "host-copies-main":
        sys.exit(host_copies_main(rest))
    if command == "loopback-listeners":
        sys.exit(loopback_listeners())
    raise SystemExit(f"unknown command {command!r}")
