"""``Collector(..., backend=...)``: TorchRL 0.14's one constructor for every backend."""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
from mocks import CountingPolicy

from rlharvest import service_backend
from rlharvest.collectors import BaseCollector, Collector, MultiAsyncCollector, MultiCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector, RPCCollector
from rlharvest.envs import CountingEnv

pytestmark = pytest.mark.timeout(90)


def test_signature_shows_the_collector_parameters():
    parameters = inspect.signature(Collector).parameters
    assert "self" not in parameters and list(parameters)[:2] == ["create_env_fn", "policy"]
    for name in ("backend", "backend_options", "num_collectors", "sync"):
        assert parameters[name].default is None and parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert "backend" not in inspect.signature(MultiSyncCollector).parameters


@pytest.mark.parametrize("kwargs, expected", [
    ({}, Collector),
    ({"backend": "direct"}, Collector),
    ({"backend": "direct", "num_collectors": 1}, Collector),
    ({"num_collectors": 2}, MultiAsyncCollector),
    ({"num_collectors": 2, "sync": True}, MultiSyncCollector),
    ({"backend": "process", "num_collectors": 2, "sync": False}, MultiAsyncCollector),
    ({"backend": "multiprocessing", "sync": True}, MultiSyncCollector),
])
def test_local_backends(kwargs, expected):
    collector = Collector(CountingEnv, CountingPolicy(), frames_per_batch=8, total_frames=8, **kwargs)
    try:
        assert type(collector) is expected and isinstance(collector, BaseCollector)
        assert sum(b.numel() for b in collector) == 8
        if expected is not Collector:
            assert collector.num_workers == kwargs.get("num_collectors", 1)
    finally:
        collector.shutdown()


def test_a_list_of_env_constructors_fixes_the_number_of_collectors():
    collector = Collector([CountingEnv] * 3, backend="process", sync=True, frames_per_batch=6, total_frames=6)
    try:
        assert collector.num_workers == 3
        assert next(iter(collector)).shape == (3, 2)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("backend, expected", [("distributed", DistributedCollector), ("rpc", RPCCollector)])
def test_node_backends_take_backend_options(backend, expected, free_port):
    collector = Collector(CountingEnv, CountingPolicy(), backend=backend, num_collectors=2, sync=True,
                          backend_options={"launcher": "mp", "tcp_port": free_port},
                          frames_per_batch=8, total_frames=8)
    try:
        assert type(collector) is expected and collector.num_workers == 2 and collector.launcher == "mp"
        assert next(iter(collector)).shape == (2, 4)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("backend, path", [
    ("process", "rlharvest.collectors.multi.MultiCollector"),
    ("multiprocessing", "rlharvest.collectors.multi.MultiCollector"),
    ("distributed", "rlharvest.collectors.distributed.DistributedCollector"),
    ("submitit", "rlharvest.collectors.distributed.DistributedCollector"),
    ("rpc", "rlharvest.collectors.distributed.RPCCollector"),
    ("ray", "rlharvest.collectors.distributed.RayCollector"),
])
def test_the_backend_class_is_looked_up_when_collector_is_called(backend, path):
    """As TorchRL: what sits at the public path when Collector is called (here a mock) is what it builds."""
    with mock.patch(path) as target:
        built = Collector(CountingEnv, backend=backend, backend_options={"option": 1}, num_collectors=2,
                          frames_per_batch=8)
    assert built is target.return_value
    args, kwargs = target.call_args
    assert args == ([CountingEnv, CountingEnv],) and kwargs["sync"] is False and kwargs["option"] == 1
    assert kwargs.get("launcher") == ("submitit" if backend == "submitit" else None)
    assert kwargs.get("num_collectors") == (2 if backend == "ray" else None)


def test_a_service_backend_context_builds_the_class_found_when_collector_is_called():
    with mock.patch("rlharvest.collectors.distributed.RPCCollector") as target, service_backend("rpc"):
        built = Collector(CountingEnv, num_collectors=2, frames_per_batch=8)
    assert built is target.return_value and target.call_args.kwargs["sync"] is False


def test_collector_and_multicollector_keep_their_rules_while_their_module_names_are_replaced():
    with mock.patch("rlharvest.collectors.multi.MultiCollector"), mock.patch("rlharvest.collectors.single.Collector"):
        collector = MultiCollector([CountingEnv], frames_per_batch=4, total_frames=4, sync=False)
        try:
            assert type(collector) is MultiAsyncCollector
        finally:
            collector.shutdown()
        with pytest.raises(TypeError, match="only Collector"):  # a subclass still refuses the selectors
            type("MyCollector", (Collector,), {})(CountingEnv, frames_per_batch=4, num_collectors=2)
        direct = Collector(CountingEnv, frames_per_batch=4, total_frames=4)
        assert type(direct) is Collector


@pytest.mark.parametrize("kwargs, error, match", [
    ({"backend": "threads"}, ValueError, "backend must be one of"),
    ({"backend": "process", "num_collectors": 0}, ValueError, "positive integer"),
    ({"backend": "process", "num_collectors": True}, TypeError, "positive integer"),
    ({"backend": "direct", "num_collectors": 2}, ValueError, "at most one"),
    ({"backend": "direct", "sync": True}, ValueError, "sync"),
    ({"backend": "direct", "backend_options": {"x": 1}}, ValueError, "backend_options"),
    ({"backend": "process", "backend_options": {"sync": True}}, ValueError, "reserved"),
    ({"backend": "process", "backend_options": {"frames_per_batch": 4}}, ValueError, "duplicate"),
    ({"backend": "process", "sync": "yes"}, TypeError, "sync"),
    ({"backend": "submitit", "backend_options": {"launcher": "mp"}}, ValueError, "requires launcher='submitit'"),
])
def test_dispatch_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Collector(CountingEnv, frames_per_batch=8, **kwargs)


def test_dispatch_errors_about_env_constructors():
    with pytest.raises(ValueError, match="does not match"):
        Collector([CountingEnv], backend="process", num_collectors=2, frames_per_batch=8)
    with pytest.raises(ValueError, match="exactly one"):
        Collector([CountingEnv, CountingEnv], backend="direct", frames_per_batch=8)
    with pytest.raises(ValueError, match="duplicate"):
        Collector(CountingEnv, None, backend="process", backend_options={"policy": None}, frames_per_batch=8)
    with pytest.raises(TypeError, match="at most"):
        Collector(CountingEnv, None, 3, backend="process", frames_per_batch=8)


def test_subclasses_refuse_the_selectors():
    class MyCollector(Collector):
        pass

    with pytest.raises(TypeError, match="only Collector"):
        MyCollector(CountingEnv(), frames_per_batch=4, num_collectors=2)
    with pytest.raises(TypeError):
        MultiSyncCollector([CountingEnv], frames_per_batch=4, backend="process")


def test_service_backend_context_picks_the_backend(free_port):
    with service_backend("rpc"):
        collector = Collector(CountingEnv, CountingPolicy(), num_collectors=2, sync=True, frames_per_batch=8,
                              total_frames=8, backend_options={"launcher": "mp", "tcp_port": free_port})
    try:
        assert type(collector) is RPCCollector and collector.num_workers == 2
        assert next(iter(collector)).shape == (2, 4)
    finally:
        collector.shutdown()


def test_service_backend_context_yields_to_an_explicit_backend_and_is_restored():
    with service_backend("multiprocessing"):
        collector = Collector(CountingEnv, CountingPolicy(), backend="direct", frames_per_batch=4)
        assert type(collector) is Collector
        with service_backend("direct"):
            assert type(Collector(CountingEnv, frames_per_batch=4)) is Collector
        collector = Collector(CountingEnv, CountingPolicy(), frames_per_batch=4, total_frames=4)
        try:
            assert type(collector) is MultiAsyncCollector and collector.num_workers == 1
        finally:
            collector.shutdown()
    assert type(Collector(CountingEnv, frames_per_batch=4)) is Collector


@pytest.mark.parametrize("backend", ["thread", "threading", "monarch"])
def test_service_backend_context_without_a_collector_is_refused_by_collector(backend):
    with service_backend(backend):  # TorchRL's names are valid contexts...
        with pytest.raises(ValueError, match="service_backend context"):  # ...that Collector cannot build
            Collector(CountingEnv, frames_per_batch=4)


def test_service_backend_refuses_unknown_names():
    with pytest.raises(ValueError, match="service backend must be one of"):
        with service_backend("threads"):
            pass


def test_service_backend_context_is_not_seen_by_other_threads():
    import threading

    seen = []
    with service_backend("process"):
        thread = threading.Thread(target=lambda: seen.append(type(Collector(CountingEnv, frames_per_batch=4))))
        thread.start()
        thread.join(30)
    assert seen == [Collector]
