"""The in-repo TileLang kernels (``kernels/``, import name ``qlabench_kernels``).

Conventions equal the canonical ones (FLA's); one compilation per head configuration, sequence
layout at run time (``seqlens=``, read to the host once in ``prepare``, plans the split).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .base import Backend, Prepared

_Tokens = Annotated[int, Field(ge=0, multiple_of=64)]


class TileLangParams(BaseModel):
    """The run-time choices of the in-repo kernels; ``None`` leaves each to its planner."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: the forward's final kernel: 128 the fused kernel, 64 fwd_o; None: planned with the split
    fwd_block_v: Literal[64, 128] | None = None
    #: forward segment length in tokens (a multiple of 64); 0: never split; None: planned
    fwd_split_tokens: _Tokens | None = None
    #: backward chains' segment length in tokens (a multiple of 64); 0: never split; None: planned
    bwd_split_tokens: _Tokens | None = None
    #: the backward's state side on a second CUDA stream
    bwd_streams: bool = True
    #: a cost table file (``kernels/cost_tables/`` format, e.g. what ``python -m
    #: qlabench_tools.kernels.calibrate --out FILE`` wrote) the planners price with instead of the
    #: GPU model's committed one; choices given above stay as given
    cost_table: str | None = None

    @field_validator("cost_table")
    @classmethod
    def _table_loads(cls, v):
        if v is not None:
            _load_table(v)  # ValueError naming the file and the field that is wrong
        return v


def _load_table(path: str):
    from qlabench_kernels.calibration import from_file

    return from_file(path)


def table_plans(lens, h_qk: int, h_v: int, sms: int, direction: str, table) -> dict:
    """The choices ``cost_table`` makes for one batch: ``fwd`` (block_v, segment tokens) when the
    direction is fwd (under fwdbwd the forward keeps the GPU's table), ``bwd`` (segment tokens) when
    it runs the backward. ``table``: a :class:`qlabench_kernels.calibration.CostTable`."""
    import qlabench_kernels as qk

    out = {}
    if direction == "fwd":
        out["fwd"] = qk.plan_fwd(sum(lens), len(lens), h_v, sms, seqlens=list(lens), h_qk=h_qk, costs=table.fwd)
    if direction in ("bwd", "fwdbwd"):
        out["bwd"] = qk.plan_bwd_split(sum(lens), len(lens), h_v, sms, seqlens=list(lens), costs=table.bwd)
    return out


def _cost_table_file():
    """The cost table file the kernels' planners read here (``qlabench_kernels.calibration``)."""
    import qlabench_kernels.calibration as cal
    import torch

    gpu = torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else ""
    path = cal.table_path(gpu) if gpu else None
    return path if path is not None and path.is_file() else cal.table_path(cal.DEFAULT_GPU)


def _code_of(src: str) -> str:
    """``src``'s syntax tree without docstrings (module, class and function ones), dumped; the
    source itself where it does not parse."""
    import ast

    try:
        tree = ast.parse(src)
    except SyntaxError:
        return src
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


class TileLangBackend(Backend):
    name = "tilelang"
    directions = ("fwd", "bwd", "fwdbwd")
    module = "qlabench_kernels"
    color = "#9467bd"
    kind = "in-repo"
    Params = TileLangParams

    def version(self) -> str:
        """A hash of the kernel sources' code (their syntax trees, without docstrings: comments,
        docstrings and layout are not the kernels) and of the cost table that plans this machine's
        runs (the ``cost_table`` parameter's, else its GPU model's, the default one off CUDA):
        changing either makes a new resume key."""
        import hashlib
        from pathlib import Path
        try:
            import qlabench_kernels as qk
        except Exception:
            return "unknown"
        h = hashlib.sha1()
        root = Path(qk.__file__).parent
        for f in sorted(root.glob("*.py")):
            h.update(f.name.encode())
            h.update(_code_of(f.read_text()).encode())
        table = Path(self.params.cost_table) if self.params.cost_table else _cost_table_file()
        h.update(table.name.encode())
        h.update(table.read_bytes())
        return f"src-{h.hexdigest()[:10]}"

    def available(self):
        ok, why = super().available()
        if not ok:
            return ok, why
        try:
            import tilelang  # noqa: F401
        except Exception as e:
            return False, f"cannot import tilelang: {type(e).__name__}: {str(e)[:160]}"
        import qlabench_kernels as qk
        if not hasattr(qk, "chunk_gdn_fwd"):
            return False, "qlabench_kernels has no forward kernel yet"
        return True, ""

    def supports(self, point, direction):
        import qlabench_kernels as qk
        if point.head_dim != 128:
            return False, f"in-repo kernels are built for head_dim 128 (got {point.head_dim})"
        if point.dtype != "bf16":
            return False, f"in-repo kernels take bf16 q, k, v (dtype={point.dtype})"
        if direction != "fwd" and not hasattr(qk, "chunk_gdn_bwd"):
            return False, "in-repo backward kernel not built yet"
        return True, ""

    def prepare(self, x, direction):
        import qlabench_kernels as qk

        # the layout on the host, read once here (outside the timed calls), plans the sequence split
        lens = x.cu_seqlens.diff().tolist()
        p = self.params
        # the planner's forward choices replaced by the parameters (none: the planner's)
        fwd_kw = (dict(split_tokens=p.fwd_split_tokens, block_v=p.fwd_block_v, seqlens=lens)
                  if p.fwd_block_v is not None or p.fwd_split_tokens is not None else {})
        planned = {}
        if p.cost_table is not None:  # the planners' choices under that table, made here on the host
            from qlabench_kernels.plan import sm_count
            planned = table_plans(lens, x.q.shape[2], x.v.shape[2], sm_count(x.v.device), direction,
                                  _load_table(p.cost_table))
            if "fwd" in planned and not fwd_kw:
                bv, seg = planned["fwd"]
                fwd_kw = dict(split_tokens=seg, block_v=bv, seqlens=lens)

        def fwd():
            if fwd_kw:
                r = qk.chunk_gdn_fwd_lowlevel(
                    x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                    output_final_state=x.output_final_state, cu_seqlens=x.cu_seqlens, **fwd_kw)
                return r["o"], r["final_state"]
            return qk.chunk_gdn_fwd(x.q, x.k, x.v, x.g, x.beta, scale=x.scale,
                                    initial_state=x.h0, output_final_state=x.output_final_state,
                                    cu_seqlens=x.cu_seqlens, seqlens=lens)

        if direction == "fwd":
            return Prepared(fn=fwd)

        def saved():
            # the forward's prep outputs the backward reuses (g cumsum, A·diag(β), chunk table):
            # planned among the paths that run prep
            r = qk.chunk_gdn_fwd_lowlevel(x.q, x.k, x.v, x.g, x.beta, scale=x.scale,
                                          initial_state=x.h0, output_final_state=x.output_final_state,
                                          cu_seqlens=x.cu_seqlens, save_prep=True, **fwd_kw)
            return {k: r[k] for k in ("gcs", "a_beta", "ctab") if k in r}

        bwd_kw = {}
        if p.bwd_split_tokens is not None:
            bwd_kw["split_tokens"] = p.bwd_split_tokens
        elif "bwd" in planned:
            bwd_kw["split_tokens"] = planned["bwd"]
        if not p.bwd_streams:
            bwd_kw["streams"] = False

        def bwd(sv):
            return qk.chunk_gdn_bwd(x.q, x.k, x.v, x.g, x.beta, x.do, x.dht, scale=x.scale,
                                    initial_state=x.h0, cu_seqlens=x.cu_seqlens, seqlens=lens,
                                    **sv, **bwd_kw)

        if direction == "bwd":
            sv = saved()  # a forward's saved tensors, outside the timed region

            def refresh():
                for k, t in saved().items():
                    sv[k].copy_(t)
            return Prepared(fn=lambda: bwd(sv), refresh=refresh)
        return Prepared(fn=lambda: bwd(saved()))

    def outputs_to_canonical(self, raw, x, direction):
        if direction == "fwd":
            o, ht = raw[0], raw[1]
            return {"o": o, "final_state": ht}
        dq, dk, dv, dg, db, dh0 = raw[:6]
        return {"dq": dq, "dk": dk, "dv": dv, "dg": dg, "dbeta": db, "dh0": dh0}

    def path(self, names):
        """``split`` when the sequences were cut into segments (seg_state / fixup kernels ran),
        ``direct`` otherwise; ``fused-`` in front when the fused kernel ran."""
        route = "split" if any("seg_state" in n or "fixup" in n for n in names) else "direct"
        return ("fused-" if any("fwd_fused" in n for n in names) else "") + route
