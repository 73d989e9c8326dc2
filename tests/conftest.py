import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("FLA_FLASH_QLA", "0")
# the test-only backend `faulty` (tests/faulty_backend.py), registered for this process and the
# workers it starts (they inherit the environment: PYTHONPATH finds the module)
_here = os.path.dirname(os.path.abspath(__file__))
os.environ["QLABENCH_BACKENDS"] = ",".join(filter(None, [os.environ.get("QLABENCH_BACKENDS"),
                                                         "faulty=faulty_backend:FaultyBackend"]))
os.environ["PYTHONPATH"] = os.pathsep.join([_here, *filter(None, [os.environ.get("PYTHONPATH")])])
# the views fit their tables to $COLUMNS when set (qlabench.render): tests see full-width output
# unless they set it themselves
os.environ.pop("COLUMNS", None)

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
