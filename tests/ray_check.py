"""Ray tests leave no actor alive: the actor table of the session's Ray says so."""

from __future__ import annotations

import time

import pytest


def live_actors(ray) -> list[str]:
    """Class names of the actors Ray still counts as alive (or starting, or restarting)."""
    from ray._private import state  # the GCS actor table: no dashboard needed

    return [info.get("ActorClassName", "?") for info in state.actors().values() if info.get("State") != "DEAD"]


def assert_no_live_actors(ray, timeout: float = 10.0) -> None:
    """Fail if an actor is still alive after ``timeout`` seconds (Ray reports a kill asynchronously);
    kill the leftovers so that one leak does not fail the following tests."""
    deadline = time.monotonic() + timeout
    left = live_actors(ray)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = live_actors(ray)
    if left:
        pytest.fail(f"Ray actors survived the test: {left}")
