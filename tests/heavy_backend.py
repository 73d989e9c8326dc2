"""Test-only backend whose library (tests/heavy_lib.py) stands in for fla, FlashQLA or TileLang:
the reference's answer, its version the library's (so a row's version says which process
imported it). Registered by tests/test_worker_checks.py through ``$QLABENCH_BACKENDS``."""

from __future__ import annotations

from qlabench.backends.base import Backend
from qlabench.backends.reference import ReferenceBackend


class HeavyBackend(ReferenceBackend):
    name = "heavy"
    needs_cuda = False
    module = "heavy_lib"
    kind = "library"
    color = "#17becf"
    available = Backend.available  # the library imported (the reference needs none)

    def version(self) -> str:
        import heavy_lib
        return heavy_lib.__version__
