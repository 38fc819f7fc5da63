"""The public SLURM helpers of the distributed collectors: where their defaults live, and
:func:`submitit_delayed_launcher`, which starts the main job and its nodes for
``launcher="submitit_delayed"``. Starting nodes is the backend's (``rlharvest.transport.launchers``).
"""

from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any, Callable

from ...transport.keys import AUTHKEY_ENV, NodeCredential, new_authkey, parse_authkey, stretch_authkey
from ...transport.launchers import (_ALIVE_STATES, DEFAULT_SLURM_CONF, LAUNCHERS, TCP_PORT, SlurmNode, main_host_ip,
                                   submit_jobs)
from ...worker.nodes import node_main

__all__ = ["DEFAULT_SLURM_CONF", "DEFAULT_SLURM_CONF_MAIN", "TCP_PORT", "LAUNCHERS", "submitit_delayed_launcher"]

#: SLURM parameters of the main job submitted by :func:`submitit_delayed_launcher`
DEFAULT_SLURM_CONF_MAIN = {"timeout_min": 10, "slurm_partition": "train", "slurm_cpus_per_task": 32,
                           "slurm_gpus_per_node": 1}


def submitit_delayed_launcher(
    num_jobs: int,
    framework: str = "distributed",
    backend: str = "gloo",
    tcpport: int = TCP_PORT,
    submitit_main_conf: dict = DEFAULT_SLURM_CONF_MAIN,
    submitit_collection_conf: dict = DEFAULT_SLURM_CONF,
) -> Callable:
    """Decorate the main function of a job whose collector uses ``launcher="submitit_delayed"``.

    Calling the decorated function submits it as the main SLURM job, waits until that job runs and
    resolves its node's address, then submits ``num_jobs`` node jobs that join the main process's
    process group on ``tcpport``. Returns the main job's result.

    The collector's key (see docs/security.md) is ``$RLHARVEST_AUTHKEY`` if set, else a fresh one:
    it reaches the main job as ``RLHARVEST_AUTHKEY``; each node job gets, inside its pickle, only its
    rank's node key derived from it (no node can act as the learner to another).

    Args:
        num_jobs: number of nodes (one per ``create_env_fn`` entry of the collector).
        framework: ``"distributed"`` (DistributedCollector) or ``"rpc"`` (RPCCollector).
        backend: process-group backend; must match the collector's.
        tcpport: the collector's ``tcp_port``.
        submitit_main_conf: SLURM parameters of the main job.
        submitit_collection_conf: SLURM parameters of the node jobs.

    Example:
        >>> @submitit_delayed_launcher(num_jobs=2, tcpport=12345)          # doctest: +SKIP
        ... def main():
        ...     collector = DistributedCollector([make_env] * 2, policy, frames_per_batch=100,
        ...                                      launcher="submitit_delayed", tcp_port=12345)
        ...     ...
        >>> main()                                                          # doctest: +SKIP
    """
    if framework not in ("distributed", "rpc"):
        raise ValueError(f"framework must be 'distributed' or 'rpc', got {framework!r}")

    def decorator(main_func: Callable) -> Callable:
        @functools.wraps(main_func)
        def submit_all(*args, **kwargs) -> Any:
            authkey = os.environ.get(AUTHKEY_ENV) or new_authkey().hex()
            secret = stretch_authkey(parse_authkey(authkey, AUTHKEY_ENV))
            main_job, = submit_jobs(submitit_main_conf, _with_authkey, [(authkey, main_func, *args)], kwargs)
            host = _job_host(main_job)
            node_jobs = [submit_jobs(submitit_collection_conf, node_main,
                                     [(rank, num_jobs + 1, host, int(tcpport), backend, framework)],
                                     _node_key(framework, secret, rank))[0] for rank in range(1, num_jobs + 1)]
            try:
                return main_job.result()
            finally:
                for job in node_jobs:
                    SlurmNode(job).terminate(time.monotonic() + 30.0)

        return submit_all

    return decorator


def _node_key(framework: str, secret: bytes, rank: int) -> dict:
    """The start arguments that carry node ``rank``'s key (an RPC node has none: torch RPC has no key)."""
    return {"credential": NodeCredential.for_slot(secret, rank).encode()} if framework == "distributed" else {}


def _with_authkey(authkey: str, main_func: Callable, *args, **kwargs) -> Any:
    """The main job: its collector finds the key where nodes started by hand find theirs."""
    os.environ[AUTHKEY_ENV] = authkey
    return main_func(*args, **kwargs)


def _job_host(job, timeout: float = 600.0) -> str:
    """The IP address of the node a SLURM job runs on (waits until it runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = str(job.state).split()[0].upper()
        if state == "RUNNING":
            node = (job.get_info() or {}).get("NodeList", "")
            if node:
                try:
                    return socket.gethostbyname(node)
                except OSError:
                    return main_host_ip()
        elif state not in _ALIVE_STATES:
            raise RuntimeError(f"the main job {job.job_id} ended ({state}) before the nodes could be started.")
        time.sleep(0.5)
    raise TimeoutError(f"the main job {job.job_id} did not start within {timeout:g} s.")
