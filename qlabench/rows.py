"""A row of the store, made in named steps: each step a function that returns its fields, and
:func:`merge` the one place they are put together (a later step's field wins).

The steps, in the order a measured row takes them (:func:`qlabench.measure.measure_backend`):

- :func:`identity`: what the row is of — the run, the point x direction x backend label, the
  device it was measured on (:func:`qlabench.measure.base_row` adds this process's device);
- correctness figures (:func:`qlabench.measure.correctness_fields`): the worst errors and each
  output's ``rel_l2_*`` / ``max_abs_*`` / ``local_rel_l2_*``;
- timing (:func:`qlabench.measure.timing_fields`, :func:`qlabench.measure.clock_fields`);
- the kernels seen (:func:`qlabench.measure.kernel_fields`);
- derived metrics (:func:`qlabench.measure.derived_fields`);
- :func:`outcome`: ``status`` and ``reason`` (and ``wall_s``) — also what a row the supervisor
  makes for a crashed / timed-out / unavailable backend gets (:mod:`qlabench.supervisor`), and
  :func:`noted` what a reason becomes with a note added.

Nothing here imports torch: the run's process makes rows too.
"""

from __future__ import annotations

from datetime import datetime

__all__ = ["identity", "merge", "noted", "outcome"]


def identity(run_id: str, sha: str, cfg: str, p, direction: str, be_name: str, be_version: str,
             gpu_name: str, gpu_index: int | None, gpu_uuid: str, campaign_id: str | None = None,
             be_lib: str | None = None, be_params: str = "{}") -> dict:
    """The identity of a row: the run, the point ``p`` (:class:`~qlabench.sweep.Point`) x
    ``direction`` x backend label ``be_name`` (``be_lib`` its registry name, default the label;
    ``be_params`` its non-default parameters, JSON), the device, and an empty ``reason``."""
    return {
        "run_id": run_id, "git_sha": sha, "config": cfg, "point_index": p.index,
        "point_key": p.key, "recipe_hash": p.recipe_hash, "model": p.model, "tp": p.tp_label,
        "h_qk": p.h_qk, "h_v": p.h_v, "head_dim": p.head_dim, "seqlens": list(p.seqlens),
        "layout": p.layout_label, "total_tokens": p.total_tokens, "num_seqs": p.num_seqs,
        "dtype": p.dtype, "gate_recipe": p.gate_label,
        "gate_zero_frac": p.gate_zero_frac, "initial_state": p.initial_state,
        "output_final_state": p.output_final_state, "direction": direction,
        "backend": be_name, "backend_name": be_lib or be_name, "backend_version": be_version,
        "backend_params": be_params,
        "gpu_name": gpu_name,
        "gpu_index": gpu_index, "gpu_uuid": gpu_uuid, "campaign_id": campaign_id,
        "started_at": datetime.now().isoformat(timespec="milliseconds"),
        "reason": "",
    }


def outcome(status: str, reason: str | None = None, **more) -> dict:
    """A row's outcome: ``status``, ``reason`` where given, and ``more`` (``wall_s``,
    ``latency_ms`` of a row that failed after timing)."""
    return {"status": status, **({} if reason is None else {"reason": reason}), **more}


def noted(reason: str | None, note: str, sep: str = "; ") -> str:
    """``reason`` with ``note`` added (``note`` alone where there was no reason)."""
    return f"{reason}{sep}{note}" if reason else note


def merge(*parts: dict) -> dict:
    """The row: its steps' fields in order, a later step's field over an earlier one's."""
    row: dict = {}
    for part in parts:
        row.update(part)
    return row
