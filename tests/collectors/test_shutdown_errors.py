"""A shut-down collector answers every call with one clear error, and construction warnings point at
the user's line (docs/collection.md, "Shutting down")."""

from __future__ import annotations

import warnings

import pytest

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv, SerialEnv
from rlharvest.errors import CollectorShutdownError

pytestmark = pytest.mark.timeout(120)

CALLS = {
    "iteration": lambda c: next(iter(c)),
    "update_policy_weights_": lambda c: c.update_policy_weights_(),
    "stats": lambda c: c.stats(),
    "state_dict": lambda c: c.state_dict(),
    "set_seed": lambda c: c.set_seed(1),
    "reset": lambda c: c.reset(),
    "start": lambda c: c.start(),
}


def make(cls):
    if cls is Collector:
        return Collector(CountingEnv(), frames_per_batch=4, total_frames=-1)
    return cls([CountingEnv] * 2, frames_per_batch=4, total_frames=-1)


@pytest.mark.parametrize("cls", [Collector, MultiSyncCollector, MultiAsyncCollector])
def test_every_call_on_a_shut_down_collector_says_it_is_shut_down(cls):
    collector = make(cls)
    next(iter(collector))
    collector.shutdown()
    collector.shutdown()  # idempotent
    for name, call in CALLS.items():
        with pytest.raises(CollectorShutdownError, match=rf"{cls.__name__} is shut down: .* not possible") as raised:
            call(collector)
        assert isinstance(raised.value, RuntimeError), name
    if cls is not Collector:
        for call in (lambda c: c.add_collectors([CountingEnv]), lambda c: c.remove_collectors([0])):
            with pytest.raises(CollectorShutdownError, match="is shut down"):
                call(collector)


def test_a_rounded_frames_per_batch_warns_at_the_users_line():
    env = SerialEnv(2, CountingEnv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collector = Collector(env, frames_per_batch=1001, total_frames=-1)  # the line the warning names
    collector.shutdown()
    ours = [w for w in caught if "frames_per_batch=1001" in str(w.message)]
    assert ours and ours[0].filename == __file__, [(w.filename, w.lineno, str(w.message)) for w in caught]
