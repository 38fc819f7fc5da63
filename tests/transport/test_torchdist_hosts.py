"""The bookkeeping of one copy per remote host (transport/torchdist_hosts.py) and the named slots
carriers create (weight_pool.create_named); the copies themselves are tested across network
namespaces in tests/collectors/distributed/test_host_copies.py."""

from __future__ import annotations

import os
import secrets

import torch
from tensordict import TensorDict

from rlharvest.data.flat import FlatLayout
from rlharvest.transport.torchdist_hosts import RemoteHosts, shm_identity, valid_segment_name
from rlharvest.transport.weight_pool import attach_named, create_named, unlink_named

B = ("192.0.2.11", "boot", "shm")
C = ("192.0.2.12", "boot", "shm")


def test_nodes_sharing_a_host_are_routed_together_and_lone_nodes_directly():
    hosts = RemoteHosts()
    for worker, key in ((0, B), (1, B), (2, C), (3, None)):
        hosts.join(worker, key)
    direct, shared = hosts.route([0, 1, 2, 3])
    assert direct == [2, 3]  # alone on C, and a node that said no host
    assert list(shared.values()) == [[0, 1]]
    direct, shared = hosts.route([1, 2])  # one targeted node of B: its own copy
    assert direct == [1, 2] and shared == {}
    assert hosts.host_of(0) is hosts.host_of(1) is not hosts.host_of(2)


def test_a_slot_is_never_one_a_node_runs_on_or_waits_for():
    hosts = RemoteHosts()
    hosts.join(0, B)
    host = hosts.host_of(0)
    host.carrier = 0
    first, new = host.choose_slot(busy=set())
    assert new and valid_segment_name(host.slots[first]) and host.slots[first].startswith("rlh-w0-")
    second, new = host.choose_slot(busy={first})
    assert new and second != first and host.slots[second] != host.slots[first]
    assert host.choose_slot(busy={second}) == (first, False)  # alternating, whole-fleet updates
    assert host.choose_slot(busy={first, None}) == (second, False)


def test_a_carrier_that_leaves_hands_its_slot_names_to_the_next():
    hosts = RemoteHosts()
    hosts.join(0, B)
    hosts.join(1, B)
    host = hosts.host_of(0)
    host.carrier = 0
    slot, _ = host.choose_slot(set())
    name = host.slots[slot]  # named before the carrier creates it: known even if it dies creating it
    hosts.leave(1)  # not the carrier: nothing changes
    assert host.carrier == 0 and host.orphans == []
    hosts.leave(0)
    assert host.carrier is None and host.slots == {} and host.orphans == [name]
    fresh, new = host.choose_slot(set())
    assert new and fresh != slot  # slot ids are never reused: a node may still map the old one


def test_slot_names_sent_to_nodes_stay_in_dev_shm():
    assert valid_segment_name("rlh-w12-0123456789abcdef")
    for name in ("../etc/passwd", "rlh-w1-0123456789abcdef/x", "psm_1234", None, "rlh-w1-xyz"):
        assert not valid_segment_name(name)
    assert shm_identity() != ""


def test_a_named_slot_outlives_its_name_for_those_who_mapped_it():
    weights = TensorDict({"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.float64)}, [])
    layout = FlatLayout.of(weights)
    name = "rlh-w0-" + secrets.token_hex(8)
    mapping, flat, view, handle = create_named(name, layout)
    assert handle == (name, layout) and os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
    view.update_(weights)
    other, mapped = attach_named(handle)
    assert torch.equal(mapped["w"], weights["w"]) and torch.equal(mapped["b"], weights["b"])
    unlink_named(name)
    unlink_named(name)  # twice: nothing to remove
    assert not os.path.exists(f"/dev/shm/{name}")
    view["w"].fill_(7.0)  # both mappings still share the memory
    assert mapped["w"].tolist() == [7.0] * 6
    del flat, view, mapped
    other.close()
    mapping.close()
