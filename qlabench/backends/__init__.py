"""Backend registry: a backend is one class in one file, registered by name.

Where names come from (later ones win):

1. the entry-point group ``qlabench.backends`` of every installed distribution
   (``name = "package.module:Class"``): how an outside package plugs a backend in
   (``examples/plugin_backend``) and how qlabench registers its own (its ``pyproject.toml``);
2. qlabench's own ``pyproject.toml`` table of that group, when this package runs from a source
   checkout (the declaration itself, whatever the installed metadata says);
3. ``$QLABENCH_BACKENDS``: ``name=module:Class`` items, comma-separated, for a backend that is not
   packaged (the test suite's ``faulty``).

Everything else about a backend (its distribution for the version, plot colour, directions,
parameters) is an attribute of its class (:class:`base.Backend`). Names are known without
importing any backend; :func:`backend_class` imports one.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping
from pathlib import Path

from .base import Backend, Prepared, Unsupported

GROUP = "qlabench.backends"
ENV = "QLABENCH_BACKENDS"


class UnknownBackend(KeyError):
    """A name no registration provides."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@functools.lru_cache(maxsize=1)
def _installed() -> dict[str, str]:
    """Installed entry points, qlabench's own first."""
    from importlib.metadata import entry_points
    eps = sorted(entry_points(group=GROUP),
                 key=lambda ep: getattr(getattr(ep, "dist", None), "name", "") != "qlabench")
    return {ep.name: ep.value for ep in eps}


@functools.lru_cache(maxsize=1)
def _own_pyproject() -> dict[str, str]:
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not path.is_file():
        return {}
    import tomllib
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    if data.get("project", {}).get("name") != "qlabench":
        return {}
    return dict(data["project"].get("entry-points", {}).get(GROUP, {}))


def _from_env(environ: Mapping | None = None) -> dict[str, str]:
    spec = (os.environ if environ is None else environ).get(ENV, "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ValueError(f"${ENV}: {item!r} is not name=module:Class")
        out[name.strip()] = target.strip()
    return out


def registered() -> dict[str, str]:
    """name -> ``module:Class`` of every registered backend."""
    return {**_installed(), **_own_pyproject(), **_from_env()}


def names() -> tuple[str, ...]:
    """Registered backend names, qlabench's own first (in its declaration order)."""
    reg = registered()
    own = [n for n in _own_pyproject() if n in reg]
    return tuple(dict.fromkeys([*own, *_installed(), *reg]))


@functools.cache
def _load(target: str) -> type[Backend]:
    mod, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(mod), attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{target} is not a qlabench.backends.Backend subclass")
    return cls


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name`` (imported now); :class:`UnknownBackend` otherwise."""
    reg = registered()
    if name not in reg:
        raise UnknownBackend(f"unknown backend {name!r}; known: {', '.join(names())}")
    cls = _load(reg[name])
    if cls.name != name:
        raise TypeError(f"{reg[name]} is registered as {name!r} but its name is {cls.name!r}")
    return cls


def get(name: str, params: Mapping | None = None) -> Backend:
    """An instance of backend ``name`` with ``params`` (validated by its ``Params`` model)."""
    return backend_class(name)(params)


def _attr(attr: str, default) -> dict:
    out = {}
    for n in names():
        try:
            out[n] = getattr(backend_class(n), attr)
        except Exception:  # registered, but its module does not import here
            out[n] = default
    return out


def colors() -> dict[str, str | None]:
    """name -> plot colour of every registered backend (declaration order; None: it does not
    import here)."""
    return _attr("color", None)


def kinds() -> dict[str, str]:
    """name -> ``kind`` (``library``, ``in-repo``, ``reference``) of every registered backend."""
    return _attr("kind", "library")


__all__ = ["Backend", "GROUP", "Prepared", "Unsupported", "UnknownBackend", "backend_class",
           "colors", "get", "kinds", "names", "registered"]
