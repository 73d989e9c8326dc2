"""A stand-in for a backend's heavy library (tests/test_worker_checks.py): only a run's worker
may import it. ``HEAVY_LIB=crash`` kills the importing interpreter, ``HEAVY_LIB=raise`` makes the
import fail, ``HEAVY_LIB=slow`` makes it take 6 s."""

import os
import time

__version__ = "7.1"

if os.environ.get("HEAVY_LIB") == "crash":
    os.abort()
if os.environ.get("HEAVY_LIB") == "raise":
    raise ImportError("heavy_lib is broken here")
if os.environ.get("HEAVY_LIB") == "slow":
    time.sleep(6.0)
