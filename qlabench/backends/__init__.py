"""Backend registry: one file per backend, same small interface (``base.Backend``)."""

from __future__ import annotations

from .base import Backend, Prepared, Unsupported


def get(name: str) -> Backend:
    if name == "reference":
        from .reference import ReferenceBackend
        return ReferenceBackend()
    if name == "fla":
        from .fla import FLABackend
        return FLABackend()
    if name == "flashinfer":
        from .flashinfer import FlashInferBackend
        return FlashInferBackend()
    if name == "flashqla":
        from .flashqla import FlashQLABackend
        return FlashQLABackend()
    if name == "tilelang":
        from .tilelang import TileLangBackend
        return TileLangBackend()
    if name == "faulty":
        from .faulty import FaultyBackend
        return FaultyBackend()
    raise KeyError(f"unknown backend {name!r}")


__all__ = ["Backend", "Prepared", "Unsupported", "get"]
