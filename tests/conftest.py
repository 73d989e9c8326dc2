import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("FLA_FLASH_QLA", "0")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for it in items:
        if "gpu" in it.keywords:
            it.add_marker(skip)


@pytest.fixture
def tiny_point():
    from qlabench.sweep import Point
    return Point("tiny", 2, 4, 16, (1, 63, 64, 65, 130), "bf16", 0.25, 0, 0)
