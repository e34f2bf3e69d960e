"""Shared fixtures: devices to run on (CUDA joins when present), seeded RNGs."""
from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed_and_restore_torch_state():
    """Seed every test, and check that no test leaves global torch state changed."""
    random.seed(0)
    torch.manual_seed(0)
    grad_enabled = torch.is_grad_enabled()
    anomaly = torch.is_anomaly_enabled()
    dtype = torch.get_default_dtype()
    yield
    assert torch.is_grad_enabled() == grad_enabled, "a test left grad mode changed"
    assert torch.is_anomaly_enabled() == anomaly, "a test left anomaly mode changed"
    assert torch.get_default_dtype() == dtype, "a test left the default dtype changed"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
