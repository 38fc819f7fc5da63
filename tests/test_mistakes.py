"""A newcomer's mistakes get errors that name them: what was wrong, what was given, what is allowed.

Each in one process (``Collector``) and with workers (``MultiSyncCollector``), where it applies.
"""

from __future__ import annotations

import builtins
import re
import socket
import warnings
from pathlib import Path

import pytest
import torch
from cartpole_checks import cartpole_step
from tensordict.nn import TensorDictModule

import rlharvest.errors
from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.config import CollectorConfig
from rlharvest.envs import CountingEnv, GymEnv
from rlharvest.errors import (
    ActionKeyError,
    ActionReadWarning,
    ActionSpecError,
    AddressNotAvailableError,
    PortInUseError,
    RemoteFailure,
    WorkerError,
)
from rlharvest.transport.channel import listen
from rlharvest.transport.ports import check_local_address, port_is_free

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
#: an address of no interface of this machine (TEST-NET-3, reserved for documentation)
NOT_HERE = "203.0.113.7"


class Logits(torch.nn.Module):
    """What a policy network outputs before an action is chosen: one float per action."""

    def forward(self, observation):
        return torch.stack([observation[..., 2], -observation[..., 2]], -1)


class OneHotSample(torch.nn.Module):
    """A float one-hot action (0. and 1.), as TorchRL's OneHotCategorical samples it: an action."""

    def forward(self, observation):
        return torch.nn.functional.one_hot((observation[..., 2] > 0).long(), 2).float()


def cartpole():
    return GymEnv("CartPole-v1")  # one-hot actions


def categorical_cartpole():
    return GymEnv("CartPole-v1", categorical_action_encoding=True)  # one integer action


def collect(kind: str, policy, env=cartpole):
    if kind == "one process":
        collector = Collector(env, policy, frames_per_batch=20, total_frames=40)
    else:
        collector = MultiSyncCollector([env], policy, frames_per_batch=20, total_frames=40)
    try:
        return [batch for batch in collector]
    finally:
        collector.shutdown()


def message_of(err: BaseException) -> str:
    """The message part of a worker's error (before its remote traceback), or the error's."""
    return str(err).split("\n\nRemote traceback:", 1)[0]


@pytest.mark.parametrize("kind", ["one process", "workers"])
def test_a_policy_that_writes_another_key_names_it_the_key_expected_and_the_spec(kind):
    policy = TensorDictModule(OneHotSample(), in_keys=["observation"], out_keys=["act"])
    with pytest.raises(KeyError) as info:  # a KeyError, as the env's own lookup was
        collect(kind, policy)
    assert isinstance(info.value, ActionKeyError)
    message = message_of(info.value)
    assert "did not write the env's action 'action'" in message and "it wrote 'act'" in message, message
    assert "OneHot(shape=(2,)" in message, message
    assert not str(info.value).startswith(("'", '"')), "printed as the repr of its argument"
    if kind == "workers":
        assert isinstance(info.value, WorkerError) and "\n\nRemote traceback:\n" in str(info.value)


@pytest.mark.parametrize("kind", ["one process", "workers"])
def test_float_logits_for_a_one_hot_spec_are_read_as_torchrl_reads_them_with_one_warning(kind):
    """TorchRL's envs read a OneHot action as value.long().argmax(-1): logits in (-1, 1) are action 0.
    rlharvest's GymEnv reads them so too, and says so once (in the process that collects)."""
    policy = TensorDictModule(Logits(), in_keys=["observation"], out_keys=["action"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = collect(kind, policy)
    batch = torch.cat(batches, -1)
    assert batch["action"].dtype == torch.float32 and (batch["action"].abs() < 1).all()
    # every step pushed left (action 0), whatever the logits' argmax: the physics says which action was taken
    assert _pushed_left(batch)
    read = [w for w in caught if issubclass(w.category, ActionReadWarning)]
    if kind == "one process":
        assert len(read) == 1, [str(w.message) for w in caught]
        message = str(read[0].message)
        assert "shape (2,), dtype torch.float32" in message and "OneHot(shape=(2,), dtype=torch.int64, n=2)" in message
        assert "value.long().argmax(-1)" in message and "lies in (-1, 1): action 0" in message, message
    else:
        assert read == []  # it went to the worker's stderr


def _pushed_left(batch) -> bool:
    """Whether every transition of this CartPole batch is a step with action 0 (push left)."""
    expected = cartpole_step(batch["observation"], torch.zeros(batch.shape))
    return bool(((expected - batch["next", "observation"].double()).abs() < 1e-4).all())


@pytest.mark.parametrize("kind", ["one process", "workers"])
def test_an_action_the_env_cannot_take_either_is_refused_at_the_first_step_with_both_named(kind):
    """Two logits for one categorical action: TorchRL's GymEnv hands CartPole an array, which it refuses."""
    policy = TensorDictModule(Logits(), in_keys=["observation"], out_keys=["action"])
    with pytest.raises(ValueError) as info:
        collect(kind, policy, env=categorical_cartpole)
    assert isinstance(info.value, ActionSpecError)
    message = message_of(info.value)
    assert "shape (2,), dtype torch.float32" in message and "Categorical(shape=(), dtype=torch.int64, n=2)" in message
    assert "holds 2 values where the spec holds 1" in message, message
    assert "the env failed at its first step with it, as it does under TorchRL (AssertionError" in message, message
    assert isinstance(info.value, WorkerError) == (kind == "workers")
    if kind == "one process":
        assert isinstance(info.value.__cause__, AssertionError)  # CartPole's own check, chained


class Index(torch.nn.Module):
    """The index of the chosen action, where a one-hot spec wants a vector."""

    def forward(self, observation):
        return (observation[..., 2] > 0).long()


def test_actions_of_another_dtype_are_taken_and_another_shape_is_read_as_torchrl_reads_it():
    float_one_hot = TensorDictModule(OneHotSample(), in_keys=["observation"], out_keys=["action"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 0. and 1.: an action, nothing to say
        assert collect("one process", float_one_hot)[0]["action"].dtype == torch.float32
    index = TensorDictModule(Index(), in_keys=["observation"], out_keys=["action"])
    with pytest.warns(ActionReadWarning, match=r"'action' \(shape \(\), dtype torch.int64\).*OneHot\(shape=\(2,\), "
                                               r"dtype=torch.int64, n=2\).*holds 1 values where the spec holds 2"):
        batches = collect("one process", index)
    # an index where a one-hot is wanted reads as TorchRL reads it: the argmax of one value, action 0
    assert _pushed_left(torch.cat(batches, -1))


def test_a_worker_error_prints_its_message_then_the_remote_traceback_as_lines():
    try:
        {}["action"]
    except KeyError as err:
        failure = RemoteFailure.capture(err, 0)
    raised = failure.to_exception("'collect'")
    assert isinstance(raised, KeyError) and isinstance(raised, WorkerError)
    text = str(raised)
    assert text.startswith("worker 0: 'collect' failed with KeyError: 'action'\n\nRemote traceback:\nTraceback"), text
    assert "\\n" not in text


def test_total_frames_is_quoted_as_given():
    with pytest.raises(RuntimeError, match=r"total_frames=-5 makes an endless collector"):
        CollectorConfig(frames_per_batch=10, total_frames=-5).num_batches(10)
    with pytest.raises(RuntimeError, match=r"total_frames=None makes an endless collector"):
        CollectorConfig(frames_per_batch=10, total_frames=None).num_batches(10)


def test_an_address_not_on_this_host_is_not_reported_as_a_port_in_use():
    with pytest.raises(AddressNotAvailableError, match=f"bind_address='{NOT_HERE}' is not an address of this host"):
        check_local_address(NOT_HERE)
    with pytest.raises(AddressNotAvailableError, match=NOT_HERE):
        port_is_free(29500, NOT_HERE)
    with pytest.raises(AddressNotAvailableError, match=NOT_HERE):
        listen(NOT_HERE, 29500)


def test_a_port_in_use_is_still_reported_as_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"ports {port}..{port} are all in use"):
            listen("127.0.0.1", port, attempts=1)


def test_a_distributed_collector_names_a_bind_address_not_on_this_host():
    from rlharvest.collectors.distributed import DistributedCollector

    with pytest.raises(AddressNotAvailableError, match=f"bind_address='{NOT_HERE}'"):
        DistributedCollector([CountingEnv], None, launcher="external", tcp_port=0, bind_address=NOT_HERE,
                             frames_per_batch=4, total_frames=8)


def test_every_exception_the_docs_name_imports_from_rlharvest_errors():
    named = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        # (a name qualified by its module, e.g. urllib.error.HTTPError, is not ours)
        named |= set(re.findall(r"(?<![\w.])([A-Z]\w*(?:Error|Warning|Refused|Unreachable))\b", page.read_text()))
    ours = {name for name in named if not hasattr(builtins, name)}
    assert {"RestartLimitError", "CheckpointMismatchError", "WorkerError"} <= ours, ours
    missing = sorted(name for name in ours if not hasattr(rlharvest.errors, name))
    assert not missing, f"named in the docs, not importable from rlharvest.errors: {missing}"
