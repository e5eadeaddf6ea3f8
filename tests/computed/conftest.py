"""Fixtures for the compute daemon's tests: tiny checkpoints built once per session."""

from __future__ import annotations

import pytest
import torch

from tests.models import TinyModels

# Tiny matrices gain nothing from intra-op threads, and on a shared, busy CPU spinning
# OpenMP workers made these tests ~5x slower (97 s vs 20 s measured).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))
