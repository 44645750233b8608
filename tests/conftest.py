import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/_helpers.py

# Kernel outputs are allocated through flashdelta.kernels._tl.alloc, which poisons them with NaN when set.
os.environ.setdefault("FLASHDELTA_POISON", "1")


def _has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    gpu_dir = os.path.join(os.path.dirname(__file__), "gpu")
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper (SM90) GPU")
    hopper = _has_hopper()
    for item in items:
        if str(item.fspath).startswith(gpu_dir):
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not hopper:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
