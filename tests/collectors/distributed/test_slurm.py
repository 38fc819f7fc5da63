"""DistributedCollector's submitit launchers against the real local SLURM cluster (ci/slurm_up.sh).

Node jobs run on the one-node cluster as root with this interpreter, this working directory and this
environment; they reach the main process at 127.0.0.1 (what ``main_host_ip()`` resolves here).
Every test runs in ``tmp_path`` (submitit's ``log_test`` folder goes there), so the ids of the jobs a
test submitted are read from that folder and checked against ``squeue`` afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from mocks import CountingPolicy

from rlharvest import WorkerError
from rlharvest.collectors.distributed import DistributedCollector, RPCCollector, submitit_delayed_launcher
from rlharvest.envs import ContinuousMockEnv, CountingEnv
from rlharvest.transport.ports import free_port_block

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _node_scripts  # noqa: E402  (needs HERE on sys.path; submitit pickles its functions by reference)
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.slurm

# The cluster has 8 one-CPU slots and no GPU: the defaults (32 CPUs, 1 GPU for the main job) are rejected.
SLURM_KWARGS = dict(_node_scripts.SLURM_TEST_CONF)


def _require_slurm() -> None:
    """Fail (not skip: CI starts the cluster first) with what to do when SLURM is not usable."""
    try:
        res = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10)
        problem = None if res.returncode == 0 else res.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        problem = str(err)
    if problem is not None:
        pytest.fail(f"no usable SLURM cluster ({problem}): run ci/slurm_up.sh (or `make services`), "
                    "or deselect these tests with -m 'not slurm'", pytrace=False)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in tmp_path (submitit logs), with tests/ and this folder on the jobs' PYTHONPATH."""
    _require_slurm()
    monkeypatch.chdir(tmp_path)
    path = [HERE, TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    return tmp_path


def live_job_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10, check=True).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def submitted_job_ids(folder) -> set[str]:
    """Ids of the jobs submitit submitted from ``folder`` (its log_test holds ``<id>_submitted.pkl``)."""
    logs = folder / "log_test"
    if not logs.exists():
        return set()
    return {m.group(1) for name in os.listdir(logs) if (m := re.match(r"^(\d+)_submitted\.pkl$", name))}


def job_logs(folder) -> str:
    """The tails of the jobs' logs, for failure messages."""
    logs = folder / "log_test"
    out = []
    for name in sorted(os.listdir(logs)) if logs.exists() else []:
        if name.endswith((".out", ".err")):
            text = (logs / name).read_text(errors="replace")[-1500:]
            out.append(f"--- {name}\n{text}")
    return "\n".join(out)


def assert_jobs_gone(folder, expected: int, timeout: float = 10.0) -> None:
    ids = submitted_job_ids(folder)
    assert len(ids) == expected, f"expected {expected} submitted jobs, found {sorted(ids)}"
    deadline = time.monotonic() + timeout
    left = ids & live_job_ids()
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = ids & live_job_ids()
    if left:
        subprocess.run(["scancel", *sorted(left)], check=False)  # do not leave them to the next tests
        pytest.fail(f"SLURM jobs {sorted(left)} still in squeue {timeout:g} s after the collector was closed\n"
                    + job_logs(folder))


def local_children() -> list[str]:
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            helper = "multiprocessing.resource_tracker" in cmdline or "multiprocessing.forkserver" in cmdline
            if child.status() != psutil.STATUS_ZOMBIE and not helper:  # helpers: per interpreter, not ours
                out.append(f"{child.pid}: {cmdline[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def timed_shutdown(collector) -> float:
    start = time.monotonic()
    collector.shutdown()
    return time.monotonic() - start


def assert_closed_cleanly(folder, shutdown_seconds: float, jobs: int = 2) -> None:
    """Shutdown was bounded, and left no SLURM job and no local process."""
    assert shutdown_seconds < 30, f"shutdown took {shutdown_seconds:.1f} s"
    assert_jobs_gone(folder, expected=jobs)
    assert local_children() == []
    # the job pickles hold the collector's key: only we may enter their folder (docs/security.md)
    assert os.stat(folder / "log_test").st_mode & 0o777 == 0o700


def make(envs, **kwargs):
    kwargs.setdefault("launcher", "submitit")
    kwargs.setdefault("tcp_port", free_port_block(3))
    kwargs.setdefault("slurm_kwargs", SLURM_KWARGS)
    return DistributedCollector(envs, kwargs.pop("policy", None), **kwargs)


# ---------------------------------------------------------------- a. launcher="submitit", 2 node jobs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync", [True, False])
def test_submitit_two_nodes_core_behaviours(in_tmp, sync):
    frames_per_batch = 20
    total_frames = 80 if sync else 120
    policy = CountingPolicy(1.0)
    collector = make([lambda: CountingEnv(max_steps=3)] * 2, policy=policy, frames_per_batch=frames_per_batch,
                     total_frames=total_frames, sync=sync)
    try:
        assert sorted(submitted_job_ids(in_tmp)) == sorted(str(node.job.job_id) for node in engine_of(collector).backend.launched)
        batches, per_node = [], {0: set(), 1: set()}
        for i, batch in enumerate(collector):
            batches.append(batch.clone())
            assert batch.numel() == frames_per_batch
            assert batch.names[-1] == "time"
            ids = batch["collector", "traj_ids"]
            if sync:
                assert batch.shape == (2, frames_per_batch // 2)
                for node in (0, 1):
                    per_node[node] |= set(ids[node].tolist())
            else:
                assert batch.shape == (frames_per_batch,)
                node = int(ids[0]) % 2
                assert (ids % 2 == node).all(), f"an async batch mixes nodes: {ids.tolist()}"
                per_node[node] |= set(ids.tolist())
            if i == 0:
                with torch.no_grad():
                    policy.weight.fill_(2.0)
                collector.update_policy_weights_()
        assert sum(b.numel() for b in batches) == total_frames
        assert per_node[0] and per_node[1], "both nodes must contribute"
        assert per_node[0].isdisjoint(per_node[1])
        assert (batches[0]["action"] == 1).all()
        if sync:
            # the update reached both nodes before the next request
            assert all((b["action"] == 2).all() for b in batches[1:])
        else:
            # at most one in-flight rollout per node predates the update
            assert all((b["action"] == 2).all() for b in batches[3:])
    finally:
        shutdown_seconds = timed_shutdown(collector)
    assert_closed_cleanly(in_tmp, shutdown_seconds)


@pytest.mark.timeout(120)
def test_rpc_collector_through_submitit(in_tmp):  # issue 5: RPC core behaviours, nodes as SLURM jobs
    policy = CountingPolicy(1.0)
    collector = RPCCollector([lambda: CountingEnv(max_steps=3)] * 2, policy, launcher="submitit",
                             tcp_port=free_port_block(3), slurm_kwargs=SLURM_KWARGS, frames_per_batch=20,
                             total_frames=100, sync=True)
    try:
        assert len(submitted_job_ids(in_tmp)) == 2
        batches, per_node = [], {0: set(), 1: set()}
        for i, batch in enumerate(collector):
            batches.append(batch.clone())
            assert batch.shape == (2, 10) and batch.names[-1] == "time"
            for node in (0, 1):
                per_node[node] |= set(batch["collector", "traj_ids"][node].tolist())
            with torch.no_grad():
                if i == 0:  # only node 1
                    policy.weight.fill_(2.0)
                    collector.update_policy_weights_(worker_ids=[1])
                elif i == 1:
                    policy.weight.fill_(3.0)
                    collector.update_policy_weights_()
        assert sum(b.numel() for b in batches) == 100
        assert per_node[0] and per_node[1] and per_node[0].isdisjoint(per_node[1])
        assert (batches[0]["action"] == 1).all()
        assert (batches[1]["action"][0] == 1).all() and (batches[1]["action"][1] == 2).all()
        assert all((b["action"] == 3).all() for b in batches[2:])
    finally:
        shutdown_seconds = timed_shutdown(collector)
    assert_closed_cleanly(in_tmp, shutdown_seconds)


@pytest.mark.timeout(90)
def test_shutdown_returns_as_soon_as_node_jobs_ended(in_tmp):
    """shutdown() must not outlive the node jobs by much (the learner is waiting for it).

    Regression: submitit's ``job.state`` is a cache refreshed at most every max(2 s, age/2) (up to
    60 s). When SlurmNode read it, after a few seconds of collection terminate() saw a stale "RUNNING",
    waited for the whole shutdown deadline and scancelled a finished job: shutdown() took ~10-25 s
    although the jobs were gone after ~2 s. SlurmNode now asks sacct when it needs a fresh state.
    """
    collector = make([ContinuousMockEnv], frames_per_batch=10, total_frames=-1, sync=True)
    ids = submitted_job_ids(in_tmp)
    gone: dict[str, float] = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not ids & live_job_ids():
                gone["at"] = time.monotonic()
                return
            time.sleep(0.1)

    try:
        assert collector.next().numel() == 10
        time.sleep(5)  # e.g. a learner step, without touching the collector
    finally:
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        start = time.monotonic()
        collector.shutdown()
        returned = time.monotonic()
    watcher.join(60)
    assert "at" in gone, f"the node job is still in squeue 60 s after shutdown\n{job_logs(in_tmp)}"
    jobs_ended, shutdown_took = gone["at"] - start, returned - start
    assert shutdown_took < jobs_ended + 3, (
        f"shutdown() returned {shutdown_took:.1f} s after it was called, but the node job had left squeue "
        f"{jobs_ended:.1f} s after it was called")
    assert local_children() == []


# ---------------------------------------------------------------- b. a node job that fails
@pytest.mark.timeout(90)
@pytest.mark.parametrize("failure", ["env-raises", "node-process-exits"])
def test_failing_node_job_is_named(in_tmp, failure):
    # (module-level functions of _node_scripts: the node jobs import that module to unpickle them)
    bad = _node_scripts.raising_env if failure == "env-raises" else _node_scripts.exiting_env
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        make([ContinuousMockEnv, bad], frames_per_batch=20, total_frames=40)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.worker_idx == 1, str(err)
    if failure == "env-raises":
        assert isinstance(err, ValueError)  # the remote exception type is kept
        assert "env constructor exploded on the node" in str(err)
    else:
        assert "node died" in str(err), str(err)
    assert elapsed < 60, f"the failure took {elapsed:.1f} s to surface (jobs' start included)"
    assert_jobs_gone(in_tmp, expected=2)
    assert local_children() == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["distributed-sync", "distributed-async", "rpc"])
def test_node_job_cancelled_during_collection_leaves(in_tmp, kind):
    """A node job scancelled mid-run (pre-emption, an operator): SLURM sends its processes SIGTERM, the
    node leaves (docs/elastic.md; torchdist and RPC nodes alike) and, without restarts, collection goes
    on with the other node at once. The leave is logged as a preemption, not counted as a failure."""
    if kind == "rpc":
        collector = RPCCollector([ContinuousMockEnv] * 2, None, launcher="submitit", tcp_port=free_port_block(3),
                                 slurm_kwargs=SLURM_KWARGS, frames_per_batch=20, total_frames=-1, sync=True)
    else:
        collector = make([ContinuousMockEnv] * 2, frames_per_batch=20, total_frames=-1,
                         sync=kind == "distributed-sync")
    try:
        batches = iter(collector)
        assert next(batches).numel() == 20  # both node jobs run and answer
        job_id = str(engine_of(collector).backend.launched[1].job.job_id)
        subprocess.run(["scancel", job_id], check=True, timeout=10)
        cancelled = time.monotonic()
        while collector.stats()["preemptions"] == 0 and time.monotonic() < cancelled + 60:
            next(batches)
        detected = time.monotonic() - cancelled
        after = [next(batches) for _ in range(3)]
        stats = collector.stats()
    finally:
        shutdown_seconds = timed_shutdown(collector)
    assert stats["preemptions"] == 1 and stats["restarts"] == 0, stats
    assert stats["workers"] == 1 and "preempted" in stats["worker_1/restart_causes"], stats
    assert detected < 30, f"the cancelled node job's leave was noticed {detected:.1f} s after scancel"
    assert all(batch.numel() == (20 if kind == "distributed-async" else 10) for batch in after)
    assert_closed_cleanly(in_tmp, shutdown_seconds)


@pytest.mark.timeout(90)
def test_node_that_cannot_load_its_spec_says_why(in_tmp, monkeypatch):
    """The everyday multi-host mistake: the env constructor lives in a module the node cannot import.

    A worker never dies silently (errors.py). Regression: run_node unpickled its spec outside of any
    handler, so the node died with ModuleNotFoundError in its SLURM log only, and the main process
    raised "the node died while starting: its connection closed." without the cause.
    """
    main_only = in_tmp / "main_only"  # on this process's sys.path, not on the jobs' (cwd is in_tmp)
    main_only.mkdir()
    (main_only / "rlh_main_only_envs.py").write_text(
        "from rlharvest.envs import ContinuousMockEnv\n\n\ndef make_env():\n    return ContinuousMockEnv()\n")
    monkeypatch.syspath_prepend(str(main_only))
    import rlh_main_only_envs

    try:
        with pytest.raises(WorkerError) as info:
            make([ContinuousMockEnv, rlh_main_only_envs.make_env], frames_per_batch=20, total_frames=40)
    finally:
        sys.modules.pop("rlh_main_only_envs", None)
    assert info.value.worker_idx == 1, str(info.value)
    assert_jobs_gone(in_tmp, expected=2)
    assert "No module named 'rlh_main_only_envs'" in str(info.value), (
        f"the error does not say why node 1 died:\n{info.value}")


@pytest.mark.timeout(90)
def test_node_jobs_failing_before_joining_are_named(in_tmp):
    """The jobs die before running any Python (a failing setup line): the collector must not wait forever."""
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        make([ContinuousMockEnv] * 2, frames_per_batch=20, total_frames=40,
             slurm_kwargs={**SLURM_KWARGS, "slurm_setup": ["echo 'node setup failed' >&2", "exit 3"]},
             worker_timeout=60.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.worker_idx in (0, 1), message
    assert "node died while starting" in message and "SLURM job" in message and "FAILED" in message, message
    assert elapsed < 30, f"the failure took {elapsed:.1f} s to surface"
    assert_jobs_gone(in_tmp, expected=2)
    assert local_children() == []


# ---------------------------------------------------------------- c. submitit_delayed_launcher
@pytest.mark.timeout(150)
@pytest.mark.parametrize("framework", ["distributed", "rpc"])
def test_submitit_delayed_launcher(in_tmp, framework):
    port = free_port_block(3)
    launcher = submitit_delayed_launcher(num_jobs=2, framework=framework, backend="gloo", tcpport=port,
                                         submitit_main_conf=SLURM_KWARGS, submitit_collection_conf=SLURM_KWARGS)
    main = launcher(_node_scripts.delayed_main)
    assert main.__name__ == "delayed_main"
    try:
        result = main(port, 20, 2, framework)
    except Exception as err:
        raise AssertionError(f"the main job failed: {err}\n{job_logs(in_tmp)}") from err
    assert result["shapes"] == [(2, 10), (2, 10)]
    assert all(names[-1] == "time" for names in result["names"])
    assert result["job_id"] is not None  # it really ran as a SLURM job
    for per_node in result["traj_ids"]:
        assert set(per_node[0]).isdisjoint(per_node[1])
    assert_jobs_gone(in_tmp, expected=3)  # the main job and its 2 node jobs
    assert local_children() == []


@pytest.mark.timeout(150)
def test_node_job_cancelled_during_collection_is_replaced_by_a_new_job(in_tmp):
    """With max_worker_restarts, a node job scancelled mid-run (SIGTERM: a preemption, docs/elastic.md) is
    replaced by a new SLURM job (same launcher) without spending a restart, and collection goes on:
    every batch complete, no frame twice (docs/restarts.md)."""
    from mocks import check_counting_batches, weight_policy

    collector = make([lambda: CountingEnv(max_steps=50)] * 2, policy=weight_policy(1.0), frames_per_batch=8,
                     total_frames=-1, sync=True, max_worker_restarts=1)
    try:
        batches = [collector.next().clone()]
        old_job = str(engine_of(collector).backend.launched[1].job.job_id)
        subprocess.run(["scancel", "--signal=TERM", old_job], check=True, timeout=10)
        deadline = time.monotonic() + 90
        while collector.stats()["preemptions"] == 0 and time.monotonic() < deadline:
            batches.append(collector.next().clone())
        batches += [collector.next().clone() for _ in range(3)]
        new_job = str(engine_of(collector).backend.launched[1].job.job_id)
        causes = collector.restart_causes
        stats = collector.stats()
    finally:
        shutdown_seconds = timed_shutdown(collector)
    assert [(c.worker, c.kind) for c in causes] == [(1, "preempted")] and new_job != old_job, causes
    assert stats["restarts"] == 0 and stats["workers"] == 2, stats
    check_counting_batches(batches, 8, 8 * len(batches))
    assert_closed_cleanly(in_tmp, shutdown_seconds, jobs=3)


@pytest.mark.timeout(150)
def test_add_collectors_submits_a_new_node_job(in_tmp):
    """add_collectors goes through the collector's own launcher: with "submitit" each new node is a new
    SLURM job, which joins on the current weights and fills its share of every sync batch from the next
    batch on (docs/elastic.md)."""
    policy = CountingPolicy(1.0)
    collector = make([lambda: CountingEnv(max_steps=50)], policy=policy, frames_per_batch=8, total_frames=40,
                     sync=True)
    try:
        iterator = iter(collector)
        batches = [next(iterator).clone()]
        with torch.no_grad():
            policy.weight.fill_(2.0)
        collector.update_policy_weights_()
        collector.add_collectors([lambda: CountingEnv(max_steps=50)])
        assert len(submitted_job_ids(in_tmp)) == 2 and collector.requested_frames_per_batch == 16
        batches += [batch.clone() for batch in iterator]
    finally:
        shutdown_seconds = timed_shutdown(collector)
    assert [tuple(b.shape) for b in batches] == [(1, 8), (2, 8), (2, 8)]  # total_frames=40 exactly
    assert all((b["action"] == 2).all() for b in batches[1:])  # the new node started on the current weights
    ids = [set(torch.cat([b["collector", "traj_ids"][node] for b in batches[node:]]).tolist()) for node in (0, 1)]
    assert ids[0].isdisjoint(ids[1])  # the new node's trajectory ids were never used
    assert_closed_cleanly(in_tmp, shutdown_seconds, jobs=2)


@pytest.mark.timeout(180)
def test_autoscale_submits_a_node_job_while_the_learner_starves(in_tmp):
    """autoscale= with "submitit": the node the autoscaler adds is a new SLURM job, and the sync batch
    is re-split between the two nodes from the next batch on (docs/elastic.md, "Autoscaling"). Never
    shrinking (shrink_below=0.0): a loaded machine slows the learner enough that removing the node again
    would be a right decision, and this test is about the job that adds one."""
    from mocks import SlowCountingEnv, check_trajectories, weight_policy

    from rlharvest.collectors import Autoscale

    collector = make([lambda: SlowCountingEnv(max_steps=7, delay=0.01)], policy=weight_policy(1.0),
                     frames_per_batch=12, total_frames=12 * 12,
                     sync=True, autoscale=Autoscale(1, 2, window=4, cooldown=4, grow_above=0.5, shrink_below=0.0))
    try:
        batches = [batch.clone() for batch in collector]
        decisions = collector.stats()["autoscale/decisions"]
    finally:
        shutdown_seconds = timed_shutdown(collector)
    assert [(d["action"], d["workers"]) for d in decisions] == [("add", (1,))]
    added = decisions[0]["batch"]
    assert [tuple(b.shape) for b in batches] == [(1, 12)] * added + [(2, 6)] * (12 - added)
    check_trajectories(batches, 12 * 12)
    assert_closed_cleanly(in_tmp, shutdown_seconds, jobs=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
def test_node_jobs_leave_nothing_open_and_the_port_free(in_tmp, collector_class):
    """After shutdown() the learner holds no descriptor and no port it opened for its SLURM nodes
    (tests/held.py), and a second collector starts on the same port."""
    from held import Held, held, held_since, start_process_state

    start_process_state()
    before = held()
    port = free_port_block(3)
    for _ in range(2):
        collector = collector_class([lambda: CountingEnv(max_steps=3)], CountingPolicy(1.0), launcher="submitit",
                                    tcp_port=port, slurm_kwargs=SLURM_KWARGS, frames_per_batch=4, total_frames=8)
        try:
            assert sum(batch.numel() for batch in collector) == 8
        finally:
            collector.shutdown()
        assert held_since(before) == Held({}, set())
    assert_jobs_gone(in_tmp, expected=2)
