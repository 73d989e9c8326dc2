"""What the run's process learns of its GPU once its workers are on their way: the GPU's name,
its ceilings (cached per GPU), the devices' UUIDs. This module imports torch at module level:
:func:`qlabench.runner.run` imports it only after the executor started its workers, so that
torch's import in this process overlaps theirs (the CLI imports the runner before that)."""

from __future__ import annotations

import torch

from . import metrics
from .measure import device, device_uuid, uuid_of

__all__ = ["ceilings", "device", "device_uuids", "gpu_name"]


def _index(devices: list[str] | None) -> int:
    return int(devices[0]) if devices else 0


def gpu_name(devices: list[str] | None) -> str:
    """The name of the run's (first) GPU, ``cpu`` without CUDA."""
    return torch.cuda.get_device_name(_index(devices)) if torch.cuda.is_available() else "cpu"


def ceilings(devices: list[str] | None) -> tuple[dict, str | None]:
    """The (first) GPU's measured ceilings and where they came from (:func:`metrics.cached_ceilings`);
    ({}, None) without CUDA."""
    if not torch.cuda.is_available():
        return {}, None
    return metrics.cached_ceilings(_index(devices))


def device_uuids(devices: list[str] | None) -> list[str]:
    """UUIDs of the devices a run uses (``devices``: CUDA indices, or the current device)."""
    if not torch.cuda.is_available():
        return [device_uuid()]
    return [uuid_of(int(d)) for d in (devices or [torch.cuda.current_device()])]
