"""The weight-update API on a Collector and the legacy updater interface (docs/weights.md)."""

from __future__ import annotations

import pytest
import torch
from mocks import CountingPolicy, bias_policy
from tensordict import TensorDict

from rlharvest.collectors import Collector, VanillaWeightUpdater, WeightUpdaterBase
from rlharvest.envs import CountingEnv
from rlharvest.weight_update import NoWeightSyncScheme, RemoteModuleWeightUpdater, WeightStrategy
from rlharvest.weight_update.schemes import WeightSyncScheme
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(60)


def make_collector(policy=None, **kwargs):
    return Collector(CountingEnv(max_steps=100), policy if policy is not None else CountingPolicy(),
                     frames_per_batch=4, **kwargs)


def actions(collector):
    return collector.next()["action"].unique().tolist()


# ------------------------------------------------------------------------- update_policy_weights_
def test_update_with_no_argument_rereads_the_user_policy():
    policy = CountingPolicy(1.0)
    collector = make_collector(policy)
    assert actions(collector) == [1]
    with torch.no_grad():
        policy.weight.fill_(2.0)
    # the collector runs the user's module itself: visible without an update...
    assert actions(collector) == [2]
    collector.update_policy_weights_()  # ...and an update is accepted (and bumps the version)
    assert actions(collector) == [2]


def test_update_forms_on_leaf_collector():
    policy = bias_policy(0.0)
    collector = Collector(CountingEnv(max_steps=100), policy, frames_per_batch=4, device="cpu")
    weights = TensorDict.from_module(policy).detach().clone()
    weights["module", "bias"].fill_(1)
    collector.update_policy_weights_(weights)
    assert actions(collector) == [1]
    weights["module", "bias"].fill_(2)
    collector.update_policy_weights_(weights=weights)
    assert actions(collector) == [2]
    other = bias_policy(3.0)
    collector.update_policy_weights_(policy=other)
    assert actions(collector) == [3]
    collector.update_policy_weights_({"module.bias": torch.tensor([4.0])})
    assert actions(collector) == [4]
    collector.update_policy_weights_(weights_dict={"policy": {"module": {"bias": torch.tensor([5.0])}}})
    assert actions(collector) == [5]
    with pytest.raises(KeyError, match="Model 'critic' not found"):  # as TorchRL 0.14: never silently ignored
        collector.update_policy_weights_(weights, model_id="critic")
    assert actions(collector) == [5]
    collector.update_policy_weights_(weights, worker_ids=[3])  # worker ids are ignored on a leaf
    assert actions(collector) == [2]


def test_update_with_a_copied_policy_refreshes_from_the_original():
    """When the collector had to copy the policy, update() with no argument re-reads the original."""
    policy = bias_policy(0.0)
    collector = Collector(CountingEnv(max_steps=100), policy, frames_per_batch=4)
    collector.policy = __import__("copy").deepcopy(policy)  # as if moved to another device
    collector.rollout.policy_step = __import__("rlharvest.policies", fromlist=["x"]).make_policy_step(
        collector.policy, collector.env, {"observation"}, None)
    with torch.no_grad():
        policy.module.bias.fill_(7)
    assert actions(collector) == [0]
    collector.update_policy_weights_()
    assert actions(collector) == [7]


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((CountingPolicy(),), {"weights": CountingPolicy()}, "weights"),
        ((CountingPolicy(),), {"policy": CountingPolicy()}, "policy"),
        ((), {"weights": {}, "policy": CountingPolicy()}, "weights"),
        ((), {"weights_dict": {"policy": {}}, "model_id": "policy"}, "weights_dict"),
        (({},), {"weights_dict": {"policy": {}}}, "weights_dict"),
    ],
)
def test_update_argument_conflicts(args, kwargs, match):
    collector = make_collector()
    with pytest.raises(ValueError, match=match):
        collector.update_policy_weights_(*args, **kwargs)


def test_update_key_mismatch_lists_the_missing_and_extra_names_as_lines():
    collector = make_collector()
    with pytest.raises(KeyError) as info:
        collector.update_policy_weights_({"bias": torch.zeros(1)})
    assert str(info.value).splitlines()[1:] == ["  missing: weight", "  extra: bias"], str(info.value)


def test_deprecated_policy_weights_keyword():
    collector = make_collector()
    with pytest.warns(DeprecationWarning, match="policy_weights"):
        collector.update_policy_weights_(policy_weights={"weight": torch.tensor(3.0)})
    assert actions(collector) == [3]
    with pytest.raises(TypeError, match="unexpected"):
        collector.update_policy_weights_(bogus=1)


def test_per_worker_weights_refused_on_leaf():
    collector = make_collector()
    with pytest.raises(ValueError, match="per_worker"):
        collector.update_policy_weights_({0: {"weight": torch.tensor(1.0)}})


def test_attribute_path_as_weights():
    collector = make_collector()
    collector.spare = CountingPolicy(6.0)
    collector.update_policy_weights_("spare")
    assert actions(collector) == [6]


# ------------------------------------------------------------------------- versions
def test_policy_version_bumped_on_every_update_and_stamped():  # docs/torchrl-compatibility.md, "policy versions"
    collector = make_collector(track_policy_version=True)
    assert collector.policy_version == 0
    batch = collector.next()
    assert (batch["policy_version"] == 0).all() and (batch["next", "policy_version"] == 0).all()
    assert batch["policy_version"].shape == (4,) and batch["policy_version"].dtype == torch.int64
    collector.update_policy_weights_({"weight": torch.tensor(2.0)})
    collector.increment_version()
    assert collector.get_policy_version() == 2
    assert (collector.next()["policy_version"] == 2).all()


def test_untracked_version_is_none_and_batched_tracking_works():
    assert make_collector().policy_version is None
    collector = Collector(CountingEnv(batch_size=(3,)), frames_per_batch=6, track_policy_version=True)
    assert collector.next()["policy_version"].shape == (3, 2)


def test_version_tracker_object():
    class Tracker:
        version = 10

        def increment_version(self):
            self.version += 1

    tracker = Tracker()
    collector = make_collector(track_policy_version=tracker)
    collector.increment_version()
    assert collector.policy_version == 11

    class Broken:
        version = 0

    broken = make_collector(track_policy_version=Broken())
    with pytest.raises(RuntimeError, match="increment_version"):
        broken.increment_version()


# ------------------------------------------------------------------------- receive_weights
def test_receive_weights_forms_and_conflicts():
    collector = make_collector()
    collector.receive_weights({"weight": torch.tensor(2.0)})
    assert actions(collector) == [2]
    collector.receive_weights(policy=CountingPolicy(3.0))
    assert actions(collector) == [3]
    collector.receive_weights(weights=TensorDict({"weight": torch.tensor(4.0)}, []))
    assert actions(collector) == [4]
    collector.receive_weights()  # nothing registered, nothing given: no-op
    with pytest.raises(ValueError, match="weights"):
        collector.receive_weights(CountingPolicy(), weights={})


def test_receive_weights_with_receiver_schemes():
    collector = make_collector(weight_recv_schemes={"policy": NoWeightSyncScheme()})
    assert collector._receiver_schemes["policy"].initialized_on_receiver
    assert collector._receiver_schemes["policy"].synchronized_on_receiver
    collector.receive_weights()  # pulls from the scheme: nothing there
    with pytest.raises(ValueError, match="receiver_schemes"):
        collector.receive_weights({"weight": torch.tensor(1.0)})


def test_register_scheme_receiver_deferred_and_sender_refused():
    collector = make_collector()
    scheme = NoWeightSyncScheme()
    collector.register_scheme_receiver({"policy": scheme}, synchronize_weights=False)
    assert scheme.initialized_on_receiver and not scheme.synchronized_on_receiver
    assert collector.cascade_execute("_receiver_schemes['policy'].connect") is None
    assert scheme.synchronized_on_receiver
    sender = NoWeightSyncScheme()
    sender.init_on_sender(model_id="policy")
    with pytest.raises(RuntimeError, match="sender"):
        collector.register_scheme_receiver({"policy": sender})


def test_sender_schemes_on_collector_for_env_side_models():
    scheme = NoWeightSyncScheme()
    collector = make_collector(weight_sync_schemes={"policy": scheme})
    assert scheme.initialized_on_sender and scheme.synchronized_on_sender
    collector.update_policy_weights_()
    with pytest.raises(KeyError, match="Model 'critic' not found"):
        collector.update_policy_weights_(weights_dict={"critic": {}})


def test_weight_updater_and_schemes_are_exclusive():  # TorchRL ignores one (docs/torchrl-compatibility.md)
    with pytest.raises(TypeError, match="weight_updater"):
        make_collector(weight_updater=VanillaWeightUpdater(policy_weights=TensorDict()),
                       weight_sync_schemes={"policy": NoWeightSyncScheme()})


# ------------------------------------------------------------------------- cascade_execute, init_updater
def test_cascade_execute_grammar():
    collector = make_collector()
    collector.table = {"a": [10, {"b": lambda x=1: x * 2}]}
    assert collector.cascade_execute("table['a'][0]") == 10
    assert collector.cascade_execute('table["a"][1]["b"]', 21) == 42
    assert collector.cascade_execute("requested_frames_per_batch") == 4
    with pytest.raises(ValueError, match="non-callable"):
        collector.cascade_execute("requested_frames_per_batch", 1)
    with pytest.raises(AttributeError, match="nope"):
        collector.cascade_execute("nope.x")
    with pytest.raises(KeyError):
        collector.cascade_execute("table['z']")
    with pytest.raises(IndexError):
        collector.cascade_execute("table['a'][5]")


def test_init_updater_forwards_or_is_noop():
    calls = []

    class Updater(VanillaWeightUpdater):
        def init(self, *args, **kwargs):
            calls.append((args, kwargs))

    make_collector().init_updater(1, a=2)  # no updater: no-op
    policy = CountingPolicy()
    with pytest.warns(DeprecationWarning):
        collector = make_collector(policy, weight_updater=Updater.from_policy(policy))
    collector.init_updater(1, a=2)
    assert calls == [((1,), {"a": 2})]


# ------------------------------------------------------------------------- legacy updaters
def test_legacy_updater_mode():
    policy = CountingPolicy()
    with pytest.warns(DeprecationWarning):
        collector = make_collector(policy, weight_updater=lambda: VanillaWeightUpdater.from_policy(policy))
    assert isinstance(collector.weight_updater, VanillaWeightUpdater)
    assert collector.weight_updater.collector is collector
    collector.update_policy_weights_({"weight": torch.tensor(5.0)})
    assert actions(collector) == [5]
    with pytest.raises(ValueError, match="legacy"):
        collector.update_policy_weights_({"weight": torch.tensor(5.0)}, model_id="policy")
    with pytest.raises(ValueError, match="legacy"):
        collector.update_policy_weights_(weights_dict={"policy": {}})


def test_weight_updater_base_members():
    hooks = []

    class Recorder(WeightUpdaterBase):
        def __init__(self):
            self.deliveries = []

        def _sync_weights_with_worker(self, *, worker_id=None, server_weights):
            self.deliveries.append((worker_id, server_weights))

        def all_worker_ids(self):
            return [0, 1, 2]

        def _skip_update(self, worker_id):
            return worker_id == 1

    updater = Recorder()
    assert Recorder.from_policy(CountingPolicy()) is None
    assert updater.collector is None and updater.collectors is None
    assert updater.init(1, 2) is None
    updater.increment_version()  # no collector: no-op
    assert updater.post_hooks == []
    updater.register_post_hook(lambda: hooks.append("hook"))
    weights = TensorDict({"w": torch.ones(1)}, [])
    updater(weights)
    assert [w for w, _ in updater.deliveries] == [0, 2] and hooks == ["hook"]
    updater.push_weights(weights, worker_ids=1)
    assert len(updater.deliveries) == 2 and hooks == ["hook", "hook"]  # skipped, hooks still run
    with pytest.raises(TypeError):
        updater.push_weights(None)  # _get_server_weights() -> None cannot be mapped
    with pytest.raises(TypeError):
        updater.push_weights(torch.nn.Linear(1, 1))  # plain module: not mappable by the base
    # register_collector: once only, as documented (TorchRL appends), the same one again is fine
    first, second = make_collector(), make_collector()
    updater.register_collector(first)
    updater.register_collector(first)
    with pytest.raises(RuntimeError, match="already registered"):
        updater.register_collector(second)
    assert updater.collector is first and updater.collectors == [first]
    updater.increment_version()
    assert engine_of(first).weights.version == 1
    with pytest.raises(NotImplementedError):
        WeightUpdaterBase()._sync_weights_with_worker(server_weights=weights)
    assert WeightUpdaterBase().all_worker_ids() is None


def test_subclassing_the_legacy_base_warns():
    with pytest.warns(DeprecationWarning, match="legacy"):
        class Mine(WeightUpdaterBase):  # noqa: F841
            pass


def test_failed_registration_is_reported():
    class Deaf(VanillaWeightUpdater):
        def register_collector(self, collector):
            pass

    with pytest.raises(RuntimeError, match="Failed to register collector"), pytest.warns(DeprecationWarning):
        make_collector(weight_updater=Deaf(policy_weights=TensorDict()))


def test_vanilla_weight_updater():
    policy = torch.nn.Linear(2, 1)
    getter_weights = TensorDict.from_module(policy).detach().clone().zero_()
    updater = VanillaWeightUpdater(weight_getter=lambda: getter_weights, policy_weights=TensorDict.from_module(policy))
    assert updater.all_worker_ids() is None
    updater.push_weights()
    assert float(policy.weight.abs().sum()) == 0
    VanillaWeightUpdater(policy_weights=TensorDict.from_module(policy)).push_weights()  # None: no-op


def test_remote_module_weight_updater():
    updater = RemoteModuleWeightUpdater()
    with pytest.raises(RuntimeError, match="explicit"):
        updater.push_weights()
    updater.push_weights(TensorDict({"w": torch.ones(1)}, []))


# ------------------------------------------------------------------------- schemes and strategy
def test_scheme_life_cycle_errors():
    scheme = NoWeightSyncScheme()
    with pytest.raises(RuntimeError, match="init"):
        scheme.connect()
    with pytest.raises(RuntimeError, match="init_on_sender"):
        scheme.send()
    scheme.init_on_sender(model_id="policy")
    with pytest.raises(RuntimeError, match="connect"):
        scheme.send()
    with pytest.raises(RuntimeError, match="worker_idx"):
        scheme.connect(worker_idx=0)
    scheme.connect()
    with pytest.raises(RuntimeError, match="already connected"):
        scheme.connect()
    with pytest.raises(RuntimeError, match="sender"):
        scheme.worker_idx = 1
    with pytest.raises(RuntimeError, match="receiver"):
        scheme.apply_weights({})
    receiver = NoWeightSyncScheme()
    receiver.init_on_receiver(model_id="policy")
    with pytest.raises(RuntimeError, match="weights"):
        receiver.connect(weights={})
    receiver.connect()
    assert receiver.receive() is None
    with pytest.raises(ValueError, match="model"):
        receiver.apply_weights({"w": torch.ones(1)})
    base = WeightSyncScheme()
    base.init_on_sender(model_id="policy")
    base.connect()
    with pytest.raises(RuntimeError, match="transport"):
        base.send({"w": torch.ones(1)})


def test_scheme_pickling_drops_roles():
    import pickle

    scheme = NoWeightSyncScheme()
    scheme.init_on_sender(model_id="policy", model=CountingPolicy())
    scheme.connect()
    copy = pickle.loads(pickle.dumps(scheme))
    assert not (copy.initialized_on_sender or copy.synchronized_on_sender)
    assert copy.model is None and copy.model_id == "policy"
    # the sender object itself can become a receiver (reset to its pickled state first)
    scheme.init_on_receiver(model_id="policy")
    assert scheme.initialized_on_receiver and not scheme.initialized_on_sender


def test_weight_strategy():
    with pytest.raises(ValueError, match="extract_as"):
        WeightStrategy("pickle")
    with pytest.warns(UserWarning, match="experimental"):
        as_dict = WeightStrategy("state_dict")
    module = torch.nn.Linear(2, 2)
    assert set(as_dict.extract_weights(module)) == {"weight", "bias"}
    strategy = WeightStrategy()
    with pytest.warns(UserWarning):
        assert strategy.extract_weights(42).is_empty()
    zeros = strategy.extract_weights(module).apply(torch.zeros_like)
    other = torch.nn.Linear(2, 2)
    strategy.apply_weights(other, zeros, inplace=False)
    assert other.weight.data_ptr() == zeros["weight"].data_ptr()
    strategy.apply_weights(module, {"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    assert float(module.weight.sum()) == 4
    target = {"w": torch.zeros(1)}
    strategy.apply_weights(target, {"w": torch.ones(1)})
    assert target["w"].item() == 1
    with pytest.raises(ValueError):
        strategy.apply_weights(target, {"w": torch.ones(1)}, inplace=False)
    with pytest.raises(ValueError):
        strategy.apply_weights(object(), {"w": torch.ones(1)})
    strategy.apply_weights(object(), {})  # empty weights: fine
    with pytest.raises(KeyError, match="extra: nope"):
        strategy.apply_weights(module, {"nope": torch.ones(1)})


class _RunningStats(torch.nn.Module):
    """Statistics kept outside the parameters and buffers, through get/set_extra_state."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.mean = torch.zeros(2)

    def get_extra_state(self):
        return {"mean": self.mean.clone()}

    def set_extra_state(self, state) -> None:
        self.mean = state["mean"]


@pytest.mark.parametrize("inplace", [True, False])
def test_a_modules_extra_state_travels_with_its_weights(inplace):
    source, destination = _RunningStats(), _RunningStats()
    source.mean.fill_(3.0)
    strategy = WeightStrategy()
    weights = strategy.extract_weights(source)
    assert weights["__extra_state__", "mean"].tolist() == [3.0, 3.0]
    assert "__extra_state__" not in strategy.extract_weights(torch.nn.Linear(2, 2)).keys()
    strategy.apply_weights(destination, weights, inplace=inplace)
    assert destination.mean.tolist() == [3.0, 3.0]
    assert torch.equal(destination.linear.weight, source.linear.weight)
    destination.mean.zero_()
    strategy.apply_weights(destination, weights, inplace=inplace)  # the weights kept it: applied again
    assert destination.mean.tolist() == [3.0, 3.0]
