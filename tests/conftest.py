"""Test tiers. CPU tier by default; ``--gpu`` runs the GPU tier too, and fails at once when CUDA
is missing (a GPU run on a CPU host must never look green). Nothing here touches CUDA at import."""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=50, derandomize=True)
settings.register_profile("gpu", deadline=None, max_examples=500)
settings.register_profile("dev", deadline=None, max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", default=False, help="run the GPU tier (needs CUDA)")


def pytest_configure(config):
    if config.getoption("--gpu"):
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--gpu was given but CUDA is not available: the GPU tier cannot run here")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="GPU tier: run with --gpu on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
