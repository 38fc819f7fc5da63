"""The TorchRL compatibility suite: rlharvest's collectors driven with TorchRL's envs, policies and
replay buffers, as a TorchRL user would after changing the collector imports (runs in the venv of
compat/requirements.txt, with ``make test-torchrl``; part of ``make test``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from process_check import assert_no_children, children

torch.set_num_threads(1)
# TorchRL's own start-up notices (lambda wrapped in EnvCreator, deprecated aliases) are not ours to test.
warnings.filterwarnings("ignore", module="torchrl")


@pytest.fixture(autouse=True)
def no_leftover_children():
    before = children()
    yield
    assert_no_children(before, timeout=10.0)


@pytest.fixture
def free_port():
    from rlharvest.transport.ports import free_port_block

    return free_port_block(3)
