"""YAML sweep description -> validated :class:`Sweep` (pydantic).

A sweep declares *what* to measure: head configurations (models), sequence layouts,
directions, backends, dtype, gate recipe, correctness thresholds and timing options.
*How* it is measured lives in ``timing.py``, ``metrics.py`` and ``results.py``.

Errors name the file, the field path and the bad value (:class:`ConfigError`); the CLI turns
them into exit code 2.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

DIRECTIONS = ("fwd", "bwd", "fwdbwd")

# Qwen3.5/3.6 GDN head configurations (h_qk, h_v), per tensor-parallel setting.
MODEL_PRESETS: dict[str, tuple[int, int]] = {
    "397B/122B TP8": (2, 8),
    "397B/122B TP4": (4, 16),
    "397B/122B TP2": (8, 32),
    "397B/122B TP1": (16, 64),
    "35B/9B/4B TP1": (16, 32),
    "27B TP2": (8, 24),
    "27B TP1": (16, 48),
    "2B/0.8B TP1": (16, 16),
    "35B/9B/4B TP2": (8, 16),
    "35B/9B/4B TP4": (4, 8),
    "35B/9B/4B TP8": (2, 4),
    "27B TP4": (4, 12),
    "27B TP8": (2, 6),
    "2B/0.8B TP2": (8, 8),
    "2B/0.8B TP4": (4, 4),
    "2B/0.8B TP8": (2, 2),
    "Sym h32": (32, 32),
}
MODEL_SETS: dict[str, list[str]] = {
    "qwen-fwd": [
        "397B/122B TP8", "397B/122B TP4", "397B/122B TP2", "397B/122B TP1",
        "35B/9B/4B TP1", "27B TP2", "27B TP1", "2B/0.8B TP1", "Sym h32",
    ],
    # the published backward sweep's head configs: 35B/9B/4B at TP1, 2, 4, 8
    "qwen-bwd": ["35B/9B/4B TP1", "35B/9B/4B TP2", "35B/9B/4B TP4", "35B/9B/4B TP8"],
}


class ConfigError(Exception):
    """A config problem a user can fix: message names file, field path and value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Model(_Strict):
    """One GDN head configuration. ``h_v`` must be a multiple of ``h_qk`` (GVA groups)."""

    name: str
    h_qk: Annotated[int, Field(gt=0)]
    h_v: Annotated[int, Field(gt=0)]
    head_dim: Annotated[int, Field(gt=0)] = 128

    @model_validator(mode="after")
    def _gva(self) -> Model:
        if self.h_v % self.h_qk:
            raise ValueError(
                f"h_v={self.h_v} is not a multiple of h_qk={self.h_qk} "
                "(v-head j reads q/k head j // (h_v/h_qk))"
            )
        return self


class EqualBatch(_Strict):
    """``{count: 4, length: 8192}``: four sequences of 8192 tokens."""

    count: Annotated[int, Field(gt=0)]
    length: Annotated[int, Field(gt=0)]

    def lengths(self) -> list[int]:
        return [self.length] * self.count


class RandomSplit(_Strict):
    """``{total: 32768, num_seqs: 8, seed: 42}``: a random split of a token count.

    Cut points are ``sorted(torch.randperm(total-1, generator=manual_seed(seed))[:num_seqs-1]) + 1``
    (the published backward recipe).
    """

    total: Annotated[int, Field(gt=0)]
    num_seqs: Annotated[int, Field(gt=0)]
    seed: int = 42

    @model_validator(mode="after")
    def _fits(self) -> RandomSplit:
        if self.num_seqs > self.total:
            raise ValueError(f"num_seqs={self.num_seqs} exceeds total={self.total}")
        return self

    def lengths(self) -> list[int]:
        if self.num_seqs == 1:
            return [self.total]
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        cuts = torch.randperm(self.total - 1, generator=gen)[: self.num_seqs - 1]
        bounds = [0] + (torch.sort(cuts).values + 1).tolist() + [self.total]
        return [b - a for a, b in zip(bounds, bounds[1:])]


PositiveLen = Annotated[int, Field(gt=0)]
Layout = Union[Annotated[list[PositiveLen], Field(min_length=1)], EqualBatch, RandomSplit]


class PublishedGate(_Strict):
    """``recipe: published``: g = ``logsigmoid(randn) / 16`` per token; ``zero_frac`` of v-heads get
    g = 0 (no decay), chosen with ``seed``. The published inputs use 25%; it changes how
    gate-driven sequence splitting behaves."""

    recipe: Literal["published"] = "published"
    zero_frac: Annotated[float, Field(ge=0.0, le=1.0)] = 0.25
    seed: int = 0



class StrongDecayGate(_Strict):
    """``recipe: strong-decay``: per-token log-gates uniform in ``[min_log_gate, 0]`` (default
    log(1e-6)), so a 64-token chunk's cumulative decay underflows fp32's ``exp`` by far — the end
    of the gate's range where kernels that form ``exp(G_i) / exp(G_j)`` break."""

    recipe: Literal["strong-decay"]
    min_log_gate: Annotated[float, Field(allow_inf_nan=False)] = -13.815510557964274
    seed: int = 0

    @field_validator("min_log_gate")
    @classmethod
    def _negative(cls, v: float) -> float:
        if not v < 0:
            raise ValueError(f"min_log_gate={v} must be < 0 (a log-gate > 0 makes the state grow)")
        return v



class ModelGate(_Strict):
    """``recipe: model``: the model's own gate, ``g = -exp(A_log) · softplus(a + dt_bias)`` per
    token and v-head, with ``A_log = log(U(a_range))`` and ``dt_bias = softplus⁻¹(dt)``,
    ``dt = exp(U(log dt_range))`` per head (the Qwen3-Next / Mamba2 initialisation), and ``a``
    (the projection's output) ``randn`` per token."""

    recipe: Literal["model"]
    a_range: tuple[Annotated[float, Field(gt=0, allow_inf_nan=False)],
                   Annotated[float, Field(gt=0, allow_inf_nan=False)]] = (1.0, 16.0)
    dt_range: tuple[Annotated[float, Field(gt=0, allow_inf_nan=False)],
                    Annotated[float, Field(gt=0, allow_inf_nan=False)]] = (0.001, 0.1)
    seed: int = 0

    @model_validator(mode="after")
    def _ordered(self) -> ModelGate:
        for name, (lo, hi) in (("a_range", self.a_range), ("dt_range", self.dt_range)):
            if lo > hi:
                raise ValueError(f"{name}={[lo, hi]}: low end above high end")
        return self



GATE_RECIPES = ("published", "strong-decay", "model")


def _gate_tag(v) -> str:
    if isinstance(v, dict):
        return v.get("recipe", "published")
    return getattr(v, "recipe", "published")


Gate = Annotated[
    Union[Annotated[PublishedGate, Tag("published")], Annotated[StrongDecayGate, Tag("strong-decay")],
          Annotated[ModelGate, Tag("model")]],
    Discriminator(_gate_tag, custom_error_type="unknown_gate_recipe",
                  custom_error_message=f"recipe: unknown gate recipe; known: {', '.join(GATE_RECIPES)}"),
]


class Thresholds(_Strict):
    """Relative L2 error limits per output, ``‖out − ref‖ / ‖ref‖`` against the fp32 reference;
    the local checks (``qlabench/correctness.py``) allow multiples of them.

    Derived, not chosen: twice the largest error FLA, FlashInfer and FlashQLA reach on the
    published sweeps' kept runs (``results/h200_fwd``, ``results/h200_bwd``: 171 forward and 32
    backward points, bf16 operands), rounded up to two digits — ``correctness.derive_limits``, printed by
    ``python scripts/derive_thresholds.py results/h200_fwd results/h200_bwd``. They are judged on
    other layouts and head configs (``configs/h200_serving.yaml``, the quick configs' recipes).
    """

    o: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 9.1e-3
    final_state: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 8.1e-3
    dq: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 9.5e-3
    dk: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.2e-2
    dv: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 8.8e-3
    dg: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.2e-2
    dbeta: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 9.6e-3
    dh0: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 5.9e-3

    def get(self, name: str) -> float:
        return getattr(self, name)


class Timing(_Strict):
    """How each row is timed (the engine owns the method; backends never time themselves).

    mode: ``graph-batch`` (calls unrolled in one CUDA graph, per-call mean per replay — the
    published method), ``graph-single`` (one call per replay), ``events`` (fallback), or ``cpu``
    (wall clock, for the CPU reference). ``l2``: ``warm`` or ``cold`` (flush L2 inside the graph
    before each call).
    """

    mode: Literal["graph-batch", "graph-single", "events", "cpu"] = "graph-batch"
    l2: Literal["warm", "cold"] = "warm"
    warmup: Annotated[int, Field(ge=0)] = 3
    min_samples: Annotated[int, Field(ge=1)] = 10
    max_samples: Annotated[int, Field(ge=1)] = 200
    rse_target: Annotated[float, Field(gt=0)] = 0.005
    budget_s: Annotated[float, Field(gt=0)] = 3.0
    calls_per_graph: Annotated[int, Field(ge=1)] | None = None  # None: fill ~graph_ms per replay
    graph_ms: Annotated[float, Field(gt=0)] = 20.0
    gpm: bool = True

    @model_validator(mode="after")
    def _order(self) -> Timing:
        if self.max_samples < self.min_samples:
            raise ValueError(f"max_samples={self.max_samples} < min_samples={self.min_samples}")
        return self


class Reference(_Strict):
    """Reference used by the correctness check: chunked (fast) or recurrent (tiny cases)."""

    impl: Literal["chunked", "recurrent"] = "chunked"
    dtype: Literal["fp32", "fp64"] = "fp32"


#: a backend label: it names part files and is a field of point keys (``|``-separated)
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]*")
#: the longest label: it names part files (with the run id and a counter) within a file name's 255 bytes
LABEL_MAX = 100
#: a label's ``@<version>`` suffix, checked against the version imported in its environment
VERSION_SUFFIX_RE = re.compile(r"@(\d+(?:\.\d+)*)$")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand(value: str, environ=None) -> tuple[str | None, str]:
    """``${VAR}`` expansion at run time: (expanded, "") or (None, why) when a variable is unset
    or empty."""
    environ = os.environ if environ is None else environ
    missing = [v for v in _VAR_RE.findall(value) if not environ.get(v)]
    if missing:
        return None, f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
    return _VAR_RE.sub(lambda m: environ[m.group(1)], value), ""


def label_version_problem(label: str, version: str) -> str:
    """"" when ``label`` has no ``@<version>`` suffix or it prefixes ``version`` (``@0.7`` matches
    0.7.4, not 0.71); else why not."""
    m = VERSION_SUFFIX_RE.search(label)
    if m is None or re.match(re.escape(m.group(1)) + r"(?![0-9])", str(version)):
        return ""
    return f"label {label} asks for version {m.group(1)}, its environment imports {version}"


class BackendEntry(_Strict):
    """One entry of ``backends:``: a registry name (``fla``) or
    ``{name: flashinfer, label: flashinfer@0.7.4, pythonpath: "${QLABENCH_FLASHINFER07_PATH}"}``.

    ``label`` (default: the name) is the rows' ``backend`` — the identity in keys, resume,
    compare, report and plots; unique in a sweep. An entry with ``python`` (an interpreter of the
    same Python version, e.g. ``${VENV}/bin/python``) and/or ``pythonpath`` (``:``-separated
    directories put before the inherited ``PYTHONPATH``) runs in a worker process of its own
    with that environment; ``${VAR}`` is expanded at run time, so no machine path is committed.
    A label ending in ``@<version>`` (digits and dots) must prefix the version imported there.

    ``params`` (``{name: tilelang, label: tl-bv64, params: {fwd_block_v: 64}}``) are the
    backend's own parameters, validated by its ``Params`` model (an unknown key is an error
    naming it); rows store the ones that differ from the defaults (``backend_params``)."""

    name: str
    label: str = ""
    python: Annotated[str, Field(min_length=1)] | None = None
    pythonpath: Annotated[str, Field(min_length=1)] | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, v):
        if isinstance(v, str):
            v = {"name": v}
        if isinstance(v, dict) and "label" not in v and isinstance(v.get("name"), str):
            v = {**v, "label": v["name"]}
        return v

    @field_validator("name")
    @classmethod
    def _known(cls, v: str, info: ValidationInfo) -> str:
        if (info.context or {}).get("validated"):
            return v
        from . import backends
        if v not in backends.registered():
            raise ValueError(f"unknown backend {v!r}; known: {', '.join(backends.names())}")
        return v

    @field_validator("label")
    @classmethod
    def _safe(cls, v: str) -> str:
        if not LABEL_RE.fullmatch(v):
            raise ValueError(f"label {v!r}: use letters, digits and . _ + - @ (starting with a "
                             "letter or digit); it names files and is a field of point keys")
        if len(v) > LABEL_MAX:
            raise ValueError(f"label {v[:20]}...: {len(v)} characters, at most {LABEL_MAX} (it names "
                             "files)")
        return v

    @field_validator("python", "pythonpath")
    @classmethod
    def _vars(cls, v: str | None) -> str | None:
        if v is not None and "$" in _VAR_RE.sub("", v):
            raise ValueError(f"{v!r}: write environment variables as ${{NAME}}")
        return v

    @model_validator(mode="after")
    def _params_of_the_backend(self, info: ValidationInfo) -> BackendEntry:
        if self.params and not (info.context or {}).get("validated"):
            from .backends import backend_class
            from .backends.base import BadParams
            try:
                backend_class(self.name).validate_params(self.params)
            except BadParams as e:
                raise ValueError(f"params: {e}") from None
            except Exception as e:  # the backend's module does not import here
                raise ValueError(f"params: cannot check them: {type(e).__name__}: {e}") from None
        return self

    @property
    def params_json(self) -> str:
        """The parameters that differ from the backend's defaults, as sorted JSON (``{}``)."""
        if not self.params:
            return "{}"
        from .backends import backend_class
        p = backend_class(self.name).validate_params(self.params)
        return json.dumps(p.model_dump(mode="json", exclude_defaults=True), sort_keys=True)

    @property
    def own_environment(self) -> bool:
        return self.python is not None or self.pythonpath is not None

    @property
    def plain(self) -> bool:
        """Written as a bare name in the YAML (and in stored sweep dumps)."""
        return self.label == self.name and not self.own_environment and not self.params


def _entry(e) -> BackendEntry:
    """A backend entry (validated when it is not one already)."""
    return e if isinstance(e, BackendEntry) else BackendEntry.model_validate(e)


class Sweep(_Strict):
    name: str
    description: str = ""
    models: Annotated[list[Union[str, Model]], Field(min_length=1)]
    seqlens: Annotated[list[Layout], Field(min_length=1)]
    directions: Annotated[list[Literal["fwd", "bwd", "fwdbwd"]], Field(min_length=1)] = ["fwd"]
    #: registry names or :class:`BackendEntry` mappings (label, python, pythonpath, params)
    backends: Annotated[list[BackendEntry], Field(min_length=1)] = ["reference"]
    dtype: Literal["bf16", "fp16"] = "bf16"
    #: one gate recipe or several (an axis of the sweep: each point runs under each recipe)
    gate: Annotated[list[Gate], Field(min_length=1)] = [PublishedGate()]
    initial_state: bool = True
    output_final_state: bool = True
    thresholds: Thresholds = Thresholds()
    timing: Timing = Timing()
    reference: Reference = Reference()
    seed: int = 0
    out: str = "runs/{name}"
    #: run points in a supervised worker process (crash/hang isolation)
    isolate: bool = True
    #: a row (inputs + reference + compile + check + timing) taking longer is killed: ``timeout``
    row_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    #: a backend whose last ``max_timeouts`` rows of the run were all ``timeout`` is not run again
    #: in this run: its remaining rows are ``skipped``, naming why (0: never skipped)
    max_timeouts: Annotated[int, Field(ge=0)] = 2

    @field_validator("gate", mode="before")
    @classmethod
    def _one_gate_is_a_list(cls, v):
        return [v] if isinstance(v, (dict, BaseModel)) else v

    @field_validator("backends")
    @classmethod
    def _unique_labels(cls, v: list[BackendEntry]) -> list[BackendEntry]:
        labels = [e.label for e in v]
        dup = sorted({b for b in labels if labels.count(b) > 1})
        if dup:
            raise ValueError(f"duplicate backend label(s) {', '.join(dup)}: give each entry its "
                             "own `label`")
        return v

    @field_serializer("backends")
    def _dump_backends(self, v: list) -> list:
        """Plain entries dump as their name: a sweep of names dumps as it did before entries."""
        out = []
        for e in map(_entry, v):
            out.append(e.name if e.plain else e.model_dump(exclude_defaults=True))
        return out

    def entries(self, labels=None) -> dict[str, BackendEntry]:
        """label -> entry, in the sweep's order; ``labels`` picks some (a label of the sweep, or
        a registry name, which is a plain entry)."""
        mine = {e.label: e for e in map(_entry, self.backends)}
        if labels is None:
            return mine
        return {b: mine.get(b) or _entry(b) for b in labels}

    @field_validator("models")
    @classmethod
    def _known_models(cls, v: list) -> list:
        for m in v:
            if isinstance(m, str) and m not in MODEL_PRESETS and m not in MODEL_SETS:
                raise ValueError(
                    f"unknown model preset {m!r}; presets: {', '.join(MODEL_PRESETS)}; "
                    f"sets: {', '.join(MODEL_SETS)}; or give {{name, h_qk, h_v}}"
                )
        return v

    @field_validator("directions")
    @classmethod
    def _unique_directions(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate directions in {v}")
        return v

    @field_validator("out")
    @classmethod
    def _out_template(cls, v: str) -> str:
        try:
            v.format(name="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"out {v!r}: only the placeholder {{name}} is known ({e!r})") from None
        return v

    @model_validator(mode="after")
    def _unique_points(self) -> Sweep:
        seen = set()
        for m in self.resolved_models():
            for lens in self.resolved_layouts():
                key = (m.h_qk, m.h_v, m.head_dim, tuple(lens))
                if key in seen:
                    raise ValueError(f"the point {m.h_qk}/{m.h_v} {list(lens)[:6]} appears twice "
                                     "(overlapping models or layouts)")
                seen.add(key)
        names = [g.recipe for g in self.resolved_gates()]
        if len(set(names)) != len(names):
            raise ValueError(f"gate: a recipe appears twice ({names}); one entry per recipe")
        return self

    def resolved_gates(self) -> list:
        return list(self.gate)

    def resolved_models(self) -> list[Model]:
        out: list[Model] = []
        for m in self.models:
            if isinstance(m, Model):
                out.append(m)
            elif m in MODEL_SETS:
                out.extend(Model(name=n, h_qk=MODEL_PRESETS[n][0], h_v=MODEL_PRESETS[n][1])
                           for n in MODEL_SETS[m])
            else:
                out.append(Model(name=m, h_qk=MODEL_PRESETS[m][0], h_v=MODEL_PRESETS[m][1]))
        return out

    def resolved_layouts(self) -> list[list[int]]:
        return [list(s) if isinstance(s, list) else s.lengths() for s in self.seqlens]


def _is_branch(p) -> bool:
    """A pydantic union-branch tag in an error's location (noise for a user)."""
    return isinstance(p, str) and (p in ("EqualBatch", "RandomSplit", "str", "Model")
                                   or p in GATE_RECIPES or "[" in p)


def _fmt_loc(loc: tuple) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif not _is_branch(p):
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or "<top>"


#: error types that say a value is not of a union branch's shape at all
_SHAPE_ERRORS = ("list_type", "model_type", "model_attributes_type", "dict_type", "string_type")


def _closest_branches(errors: list[dict]) -> list[dict]:
    """Where a value fits no branch of a union, the errors of the branch it comes closest to:
    one of its shape (not a shape mismatch), with the fewest missing or unknown fields, then
    the fewest errors; the other branches' errors are dropped."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for e in errors:
        loc = tuple(e["loc"])
        i = next((j for j, p in enumerate(loc) if _is_branch(p)), None)
        if i is not None:
            groups.setdefault(loc[:i], {}).setdefault(loc[i], []).append(e)

    def distance(errs: list[dict]) -> tuple:
        return (any(e["type"] in _SHAPE_ERRORS for e in errs),
                sum(e["type"] in ("missing", "extra_forbidden") for e in errs), len(errs))

    dropped = set()
    for branches in groups.values():
        if len(branches) > 1:
            best = min(branches, key=lambda b: distance(branches[b]))
            dropped |= {id(e) for b, errs in branches.items() if b != best for e in errs}
    return [e for e in errors if id(e) not in dropped]


def format_validation_error(path: str, err: ValidationError) -> str:
    errors = _closest_branches(err.errors())
    lines = [f"{path}: invalid sweep config ({len(errors)} problem(s))"]
    seen = set()
    for e in errors:
        loc = _fmt_loc(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        key = (loc, msg)
        if key in seen:
            continue
        seen.add(key)
        val = e.get("input")
        sval = repr(val)
        if len(sval) > 80:
            sval = sval[:77] + "..."
        lines.append(f"  {loc}: {msg} (got {sval})")
    return "\n".join(lines)


def parse(data: dict, path: str = "<config>") -> Sweep:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:
        return Sweep.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(path, e)) from None


def load(path: str | Path) -> Sweep:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text (UTF-8) YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    data = data or {}
    if isinstance(data, dict):
        data.setdefault("name", p.stem)
    return parse(data, str(p))
