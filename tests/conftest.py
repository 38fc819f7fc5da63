"""Shared fixtures: every test checks that it leaves no child process behind."""

from __future__ import annotations

import pytest
import torch
from process_check import assert_no_children, children

torch.set_num_threads(1)


def pytest_configure(config):
    """Before any test (once, in the process that starts the pytest workers): the bytecode of rlharvest
    and of the tests' modules, which every interpreter the tests start imports (Ray actors, ~125 in a run
    of the suite; SLURM node jobs, nodes in network namespaces, the zygotes, the CLI's runs). With
    ``PYTHONDONTWRITEBYTECODE`` set, as on this machine, none is written otherwise, and each of them
    compiled rlharvest again: ~0.6 s of CPU of its ~3.5 s of imports. Up to date, this costs milliseconds."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller did it
        return
    from pathlib import Path

    import rlharvest
    from rlharvest.bench import compile_sources

    compile_sources(Path(rlharvest.__file__).resolve().parent, Path(__file__).resolve().parent)


@pytest.fixture(autouse=True)
def no_leftover_children():
    before = children()
    yield
    assert_no_children(before)


@pytest.fixture(scope="session")
def zygote():
    """The process the checkpoint tests' fresh processes are forked from (tests/fresh.py). Session-scoped,
    so it is set up before a test's check of child processes and is not counted as the test's."""
    import fresh

    started = fresh.start()
    yield started
    started.close()


@pytest.fixture
def require_netns():
    """Network namespaces, or the test fails saying why (skips with RLH_NETNS_ALLOW_SKIP=1)."""
    import netns

    netns.require_in_test()


@pytest.fixture
def free_port():
    from rlharvest.transport.ports import free_port_block

    return free_port_block(3)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With ``-n 2 --dist loadgroup`` (``make test``) the Ray tests all go to one pytest worker (one
    Ray for the session) and the SLURM tests to one (one job queue), each group beside the others'
    tests; so do the tests of hosts in network namespaces (one set of hosts at a time).

    The groups come first, the Ray group first of all: a group runs one test after another in one
    process, so the longest ones start first and the other process takes the single tests meanwhile
    (with the Ray tests last, one process ran them alone for minutes at the end). The Ray tests of a
    process run one after another, and Ray is shut down after the last (:func:`pytest_runtest_teardown`):
    its daemons and the driver's gRPC port, which listens on every interface, never run beside the
    other tests of its process, whose checks they would disturb."""
    for item in items:
        for group in ("ray", "slurm"):
            if item.get_closest_marker(group) is not None:
                item.add_marker(pytest.mark.xdist_group(group))
        if "require_netns" in getattr(item, "fixturenames", ()):
            # hosts in network namespaces: their checks of /dev/shm see the whole machine's carriers
            item.add_marker(pytest.mark.xdist_group("netns"))
    items.sort(key=_group_order)


def _groups(item) -> set[str]:
    return {marker.args[0] if marker.args else marker.kwargs.get("name") for marker in item.iter_markers("xdist_group")}


def _group_order(item) -> int:
    """Ray's group first, then the other groups, then the single tests (a stable sort: a docs page's
    blocks, which share one group, keep their order)."""
    groups = _groups(item)
    return 0 if "ray" in groups else 1 if groups else 2


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of Ray's group in this process (the next one is not of it), Ray is shut
    down: the tests that follow in this process see no Ray daemon, port or child process."""
    if "ray" not in _groups(item) or (nextitem is not None and "ray" in _groups(nextitem)):
        return
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` each grouped test's id must carry its group (``...@ray``), which is
    how pytest-xdist sends a group to one worker. pytest-xdist 3.8 writes it where pytest up to 9.1
    reads node ids, not pytest 9.2: there the groups were silently ignored (a Ray per pytest process,
    a docs page's blocks split between processes), hence the pin in requirements-dev.txt and this check."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if any(True for _ in item.iter_markers("xdist_group")) and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup: {len(lost)} grouped tests lost their group (pytest-xdist and "
                                f"pytest disagree on node ids), e.g. {lost[0]}")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for every Ray test of the session (2 CPUs, no dashboard, 200 MB object store),
    shut down at the end of the session. No Ray service is needed beforehand."""
    import os

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray starts its workers at nice 15 (its ``worker_niceness``): beside the other pytest process's
    # CPU-bound tests an actor gets a few percent of a core, and a two-actor Ray test took 7 s in the
    # suite against 3.5 alone (three actors beside two busy loops: not built after 90 s, against 7.5 s
    # at nice 0). docs/ray.md, "Performance", says the same to users.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Actors import what the tests' env and policy constructors live in (tests/mocks.py).
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_session(ray_cluster):
    """Ray for one test, which must leave no actor alive (the process check cannot tell a leaked
    actor's process from Ray's own workers by parentage: it asks Ray)."""
    yield ray_cluster
    from ray_check import assert_no_live_actors

    assert_no_live_actors(ray_cluster)
