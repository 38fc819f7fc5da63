"""Shared fixtures: every test checks that it leaves no child process behind."""

from __future__ import annotations

import pytest
import torch
from process_check import assert_no_children, children

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_leftover_children():
    before = children()
    yield
    assert_no_children(before)


@pytest.fixture
def free_port():
    from rlharvest.transport.ports import free_port_block

    return free_port_block(3)
