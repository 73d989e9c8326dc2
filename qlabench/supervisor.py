"""Crash isolation: points run in worker processes that the main process supervises.

A worker (``multiprocessing`` spawn context, so CUDA is never forked) imports torch, creates its
CUDA context and checks the backends it will run (:func:`warm_up`: each one's availability and
version, its library imported by ``Backend.available``), and sends that report (``("ready",
report)``) to the main process, which never imports a backend's library itself. It then receives
one :class:`~qlabench.sweep.Task` at a time and sends back ``("start", backend)`` before each
backend and ``("row", row)`` after it; the main process writes each row durably. If the worker
dies (illegal address, abort, segfault), the backend in flight gets a ``crashed`` row with the tail
of the worker's stderr log; if a backend runs past ``row_timeout_s`` the worker is killed and the
row says ``timeout``. A fresh worker then goes on with the remaining backends. Compile caches that
live on disk (TileLang, Triton, FlashInfer JIT) survive worker restarts.

:class:`Lanes`: on a host with a core for every worker, a run has one worker per backend library
(per GPU; parameter variants of one library share it), all started first thing, so the libraries
import side by side and the slowest import is not every backend's wait; on a host with fewer
cores one worker imports every library of the run's environment. A label is *resolved* once its
check is in: its worker's report, or, where the worker died first, :func:`probe_backends` in an
interpreter of its own per backend (a library whose import kills the interpreter is then
unavailable alone, and fresh workers leave it out). A backend entry with an environment of its
own (``python:`` / ``pythonpath:`` in the YAML) is first asked in that environment
(:func:`worker_environment`: that interpreter, ``PYTHONPATH`` = the entry's directories before
the inherited ``PYTHONPATH``, and the ``sys.path`` that interpreter has with it), then its worker
starts there. Only one worker measures at a time; the others wait on their pipes or are still
importing.

SIGINT/SIGTERM in the main process never interrupt a row write (:func:`deferred_signals`).

The worker imports this module before its environment is set (``sys.path``, the pinned GPU), and
the main process imports it before it starts the workers, so nothing here imports torch or a
backend at module level: :mod:`qlabench.measure` is imported where it is used.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import spawn
from pathlib import Path

from .rows import merge, outcome

_pending: list[int] = []
_deferring = [0]


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT/SIGTERM until the block (an atomic row write) is over, then re-raise."""
    def hold(signum, frame):
        _pending.append(signum)

    old = {}
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, hold)
    except ValueError:  # not the main thread: nothing to defer
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if _pending:
            _pending.clear()
            raise KeyboardInterrupt


def install_sigterm_as_interrupt() -> None:
    """SIGTERM, and SIGINT even where the run was started with it ignored (a shell's background
    job inherits SIG_IGN), end the run like Ctrl-C: the rows in flight finish, nothing is lost."""
    def to_kbi(signum, frame):
        raise KeyboardInterrupt
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, to_kbi)
        signal.signal(signal.SIGINT, signal.default_int_handler)


class InProcess:
    """No isolation (debugging, tests of the measuring path itself)."""

    def __init__(self, sweep):
        self.sweep = sweep

    def start(self) -> None:
        pass

    def run_task(self, task, on_row) -> None:
        from .measure import measure_task

        def emit(kind, payload):
            if kind == "row":
                on_row(payload)
        measure_task(self.sweep, task, emit)

    def close(self) -> None:
        pass


def process_started_at() -> float | None:
    """Epoch seconds at which this process started (Linux /proc: its start in clock ticks since
    boot against the uptime, both to 10 ms), else None."""
    try:
        now = time.time()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return now - (uptime - start / ticks)
    except Exception:
        return None


def check_backend(name: str) -> tuple[bool, str, str]:
    """(available, reason, version) of backend ``name`` in this process: its module loaded and
    ``Backend.available`` asked (which imports its library)."""
    from . import backends as B
    try:
        be = B.get(name)
    except Exception as err:  # registered, but its module does not import here
        return (False, f"backend {name!r} does not load: {type(err).__name__}: {str(err)[:200]}",
                "unavailable")
    try:
        ok, why = be.available()
        return ok, why, be.version() if ok else "unavailable"
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e)[:200]}", "unavailable"


def warm_up(names) -> tuple[dict, dict]:
    """Check the backends ``names`` here (:func:`check_backend`), importing their libraries now
    so that the first row does not pay for it: (name -> [available, reason, version], name ->
    seconds), the seconds in the log too (``--- warm NAME: X s``)."""
    out, secs = {}, {}
    for name in names:
        t0 = time.perf_counter()
        ok, why, version = check_backend(name)
        out[name] = [ok, why, version]
        secs[name] = time.perf_counter() - t0
        print(f"--- warm {name}: {secs[name]:.1f} s{'' if ok else ' (' + why[:200] + ')'}",
              file=sys.stderr, flush=True)
    return out, secs


def _worker_main(conn, sweep_json: dict, log_path: str, env: dict | None = None,
                 sys_path: list[str] | None = None, warm: tuple = ()) -> None:
    t_proc = process_started_at()
    os.environ.update(env or {})  # before torch is imported: pins the worker's GPU
    if sys_path:  # the entry's environment (spawn hands the child the parent's sys.path)
        sys.path[:] = sys_path
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    faulthandler.enable(file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # stack on timeout
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    print(f"--- worker {os.getpid()}: {sys.executable}, sys.path {sys.path[:4]}", file=sys.stderr,
          flush=True)
    t0 = time.time()
    from .config import Sweep
    from .measure import measure_task
    # validated by the parent already; here only rebuilt (this environment need not register
    # every entry's backend)
    sweep = Sweep.model_validate(sweep_json, context={"validated": True})
    t_imports = time.time()
    print(f"--- worker imports: {t_imports - t0:.1f} s", file=sys.stderr, flush=True)
    import torch
    if torch.cuda.is_available():  # the context the rows need, made before the libraries' imports
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        print(f"--- cuda context: {time.time() - t_imports:.1f} s", file=sys.stderr, flush=True)
    t_cuda = time.time()
    t_warm = time.perf_counter()
    checks, secs = warm_up(warm)  # while the parent reads its results directory and the ceilings
    conn.send(("ready", {"backends": checks, "warm_s": secs, "timeline": {
        "process_start": t_proc, "started": t0, "imported": t_imports, "cuda": t_cuda,
        "warmed": t_cuda + time.perf_counter() - t_warm}}))
    while True:
        task = conn.recv()
        if task is None:
            break
        print(f"--- task {task.point.describe()} {task.direction} {task.backends}",
              file=sys.stderr, flush=True)
        measure_task(sweep, task, lambda kind, payload: conn.send((kind, payload)))
        conn.send(("done", None))


def _safe(label: str) -> str:
    """A label as part of a file name (``tilelang@prev`` stays, ``/`` and spaces do not)."""
    return "".join(c if c.isalnum() or c in "@._+-" else "_" for c in label)


def _tail(path: Path, n: int = 1200) -> str:
    """The useful end of a worker log: the fatal-error dump (without its module list) when
    there is one, else the last ``n`` characters."""
    try:
        data = path.read_bytes()[-200_000:].decode(errors="replace")
    except OSError:
        return ""
    i = data.rfind("Fatal Python error")
    if i >= 0:
        data = data[i:].split("Extension modules:")[0]
        return " ".join(data.split())[:n]
    return " ".join(data.split())[-n:]


def _stack(path: Path, n: int = 900) -> str:
    """The innermost frames of the last faulthandler dump in a worker log."""
    try:
        data = path.read_bytes()[-100_000:].decode(errors="replace")
    except OSError:
        return ""
    i = data.rfind("Thread 0x")
    if i < 0:
        i = data.rfind("Current thread")
    return " ".join(data[i:].split())[:n] if i >= 0 else " ".join(data.split())[-n:]


def pinned_row(task, backend: str, env: dict | None) -> dict:
    """A row of ``backend`` on ``task`` made in this process for a worker pinned by ``env``
    (its GPU, not this process's)."""
    from .measure import row_for, uuid_of
    pinned = (env or {}).get("QLABENCH_GPU_INDEX")
    device = {} if pinned is None else {"gpu_index": int(pinned), "gpu_uuid": uuid_of(int(pinned))}
    return merge(row_for(task, backend), device)


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


#: how long a started worker may take to check and import its backends (:meth:`Supervisor.poll_ready`)
READY_TIMEOUT_S = 600.0

#: the interpreter a spawned worker runs (``multiprocessing.spawn``) and the environment it
#: starts with (this process's) are process-wide state
_EXECUTABLE_LOCK = threading.Lock()


class Supervisor:
    def __init__(self, sweep, log_dir: Path, log=print, poll_s: float = 0.2,
                 env: dict | None = None, stop: threading.Event | None = None,
                 worker: WorkerEnv | None = None, warm: tuple = (), label: str | None = None):
        self.sweep = sweep
        self.label = label or (worker.label if worker else None)  # in its log's name
        self.warm = tuple(warm)  # backends the worker imports as soon as it starts
        self.stop = stop  # set: return after the row in flight (the worker is then ended)
        self.worker = worker  # a backend entry's own environment (None: this process's)
        self.env = {**(env or {}), **(worker.env if worker else {})}
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.poll_s = poll_s
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.conn = None
        self._kill_lock = threading.Lock()  # _kill from run_task and from close (another thread)
        self.started_at = 0.0
        self.n_started = 0
        self.log_paths: list[Path] = []  # every log a worker of this supervisor wrote
        self.report: dict | None = None  # the first worker's checks (:meth:`ready`)
        if threading.current_thread() is threading.main_thread():
            install_sigterm_as_interrupt()

    def _start(self) -> None:
        self.n_started += 1
        tag = self.env.get("QLABENCH_GPU_INDEX", "")
        tag = ("-gpu" + tag if tag else "") + (f"-{_safe(self.label)}" if self.label else "")
        self.log_path = self.log_dir / f"worker-{os.getpid()}{tag}-{self.n_started}.log"
        self.log_paths.append(self.log_path)
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_worker_main, args=(child, self.sweep.model_dump(mode="json"),
                                       str(self.log_path), self.env,
                                       self.worker.sys_path if self.worker else None, self.warm),
            daemon=True)
        with _EXECUTABLE_LOCK:  # the worker's interpreter starts with its environment
            exe, saved = spawn.get_executable(), {k: os.environ.get(k) for k in self.env}
            if self.worker:
                self.ctx.set_executable(self.worker.python)
                os.environ.update(self.worker.env)
            try:
                proc.start()  # self.proc only once started: an interrupt here leaves none to join
            finally:
                self.ctx.set_executable(exe)
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        self.proc = proc
        child.close()
        self.conn = parent
        self.started_at = time.monotonic()

    def start(self) -> None:
        """Start the worker now (it checks and imports ``warm``), not at the first task."""
        if self.proc is None or not self.proc.is_alive():
            self._start()

    def poll_ready(self, wait_s: float = 0.0):
        """The started worker's report once it has checked and imported ``warm``:
        ``{"backends": {name: [available, reason, version]}, "warm_s": {name: seconds},
        "timeline": {...}}`` (epoch seconds: ``process_start``, ``started``, ``imported``,
        ``cuda``, ``warmed``); None while it has not come within ``wait_s``; False when the worker
        died first or sent nothing within :data:`READY_TIMEOUT_S` of its start (it is then
        ended, and the next task starts a fresh one)."""
        if self.report is not None:
            return self.report
        if self.proc is None:
            self.start()
        end = time.monotonic() + wait_s
        while True:
            msg = self._receive(max(0.0, min(self.poll_s, end - time.monotonic())))
            why = None
            if msg is not None:
                kind, payload = msg
                if kind == "ready":
                    self.report = payload
                    return payload
                if kind == "closed":
                    why = "died"
            elif not self.proc.is_alive():
                why = "died"
            elif time.monotonic() > self.started_at + READY_TIMEOUT_S:
                why = f"sent no report within {READY_TIMEOUT_S:g} s"
            if why is not None:
                self.proc.join(timeout=1)
                code = self.proc.exitcode
                self._kill()
                self.log(f"worker {why} while checking its backends ({', '.join(self.warm)}); "
                         f"exit {code} | log tail: {_tail(self.log_path, 300)}")
                return False
            if time.monotonic() >= end:
                return None

    def _receive(self, wait_s: float | None = None):
        """The worker's next message ``(kind, payload)`` within ``wait_s`` (default ``poll_s``),
        ``("closed", None)`` when its pipe broke while reading, None when nothing came."""
        try:
            if not self.conn.poll(self.poll_s if wait_s is None else wait_s):
                return None
        except (EOFError, OSError):
            return None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return ("closed", None)

    def _kill(self) -> None:
        # close() and run_task's own failure path may get here from two threads: one of them takes
        # the process out and kills and joins it
        with self._kill_lock:
            proc, self.proc, self.conn = self.proc, None, None
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)

    def run_task(self, task, on_row) -> None:
        from .sweep import Task  # not at module level: see the module docstring
        remaining = list(task.backends)
        idle_deaths = 0
        while remaining:
            if self.proc is None or not self.proc.is_alive():
                self._start()
            sub = Task(task.point, task.direction, list(remaining), task.ctx)
            self.conn.send(sub)
            current = remaining[0]
            deadline = time.monotonic() + self.sweep.row_timeout_s
            failure = None
            while True:
                try:
                    msg = self._receive()
                except KeyboardInterrupt:  # the run is stopped: say what was in flight, and where
                    self._report_interrupted(task, current, deadline)
                    raise
                if msg is not None:
                    kind, payload = msg
                    if kind == "closed":
                        failure = "crashed"
                        break
                    if kind == "ready":  # a fresh worker has imported its backends
                        deadline = time.monotonic() + self.sweep.row_timeout_s
                    elif kind == "start":
                        current = payload
                        deadline = time.monotonic() + self.sweep.row_timeout_s
                    elif kind == "row":
                        on_row(payload)
                        if payload["backend"] in remaining:
                            remaining.remove(payload["backend"])
                        current = None  # its row is in: a death now is not this backend's
                        if self.stop is not None and self.stop.is_set():
                            self._kill()
                            return
                    elif kind == "done":
                        return
                    continue
                proc = self.proc
                if proc is None or not proc.is_alive():
                    failure = "crashed"
                    break
                if time.monotonic() > deadline:
                    failure = "timeout"
                    break
            # the worker died or hung on `current`
            proc = self.proc
            if failure == "crashed" and proc is not None:
                proc.join(timeout=5)
            if failure == "timeout" and proc is not None and proc.is_alive():
                self._dump_stack(proc)  # where was it stuck? -> its log
            code = proc.exitcode if proc is not None else None
            self._kill()
            if current is None:  # died between backends (e.g. during cleanup): no row to blame
                idle_deaths += 1
                self.log(f"worker {failure} between backends on {task.point.describe()}; restarting")
                if not remaining:
                    return
                if idle_deaths < 2:
                    continue
                current = remaining[0]  # it keeps dying before this backend starts: blame it
            if failure == "timeout":
                reason = (f"no result within row_timeout_s={self.sweep.row_timeout_s:g}; worker "
                          f"killed | stack: {_stack(self.log_path)}")
            else:
                sig = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                reason = f"worker died ({sig}) | log tail: {_tail(self.log_path)}"
            row = merge(pinned_row(task, current, self.env), outcome(failure, reason))
            self.log(f"worker {failure} on {task.point.describe()} {task.direction} {current}; "
                     "starting a fresh worker")
            on_row(row)
            if current in remaining:
                remaining.remove(current)

    @staticmethod
    def _dump_stack(proc) -> None:
        """Have the live worker ``proc`` write every thread's stack into its log (its SIGUSR1
        faulthandler), and give it a second to."""
        with contextlib.suppress(Exception):
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)

    def _report_interrupted(self, task, current, deadline: float) -> None:
        """A stopped run's last word on the row in flight: the backend, the point, how long it
        had run and the worker's innermost frames (its faulthandler dump, as for a timeout)."""
        proc = self.proc
        if current is None or proc is None or not proc.is_alive():
            return
        ran_s = self.sweep.row_timeout_s - (deadline - time.monotonic())
        self._dump_stack(proc)
        self.log(f"interrupted with {current} in flight on {task.point.describe()} {task.direction} "
                 f"for {ran_s:.0f} s (row_timeout_s={self.sweep.row_timeout_s:g}) | stack: "
                 f"{_stack(self.log_path) or 'none dumped'}")

    def close(self) -> None:
        proc, conn = self.proc, self.conn
        if proc is not None and conn is not None and proc.is_alive():
            try:
                conn.send(None)
                proc.join(timeout=5)
            except Exception:
                pass
        self._kill()


@dataclass(frozen=True)
class WorkerEnv:
    """Where a backend entry with an environment of its own runs: ``python`` (interpreter),
    ``env`` (``PYTHONPATH``, set in the worker before anything is imported) and ``sys_path``
    (what that interpreter's ``sys.path`` is with it, qlabench's source root appended)."""

    label: str
    python: str
    env: dict
    sys_path: tuple


#: run in a fresh interpreter: a backend's availability and version there, and sys.path
_PROBE = """
import json, sys
sys.path.append(sys.argv[2])  # qlabench itself, after the environment's own packages
from qlabench.supervisor import check_backend
ok, why, version = check_backend(sys.argv[1])
print("QLABENCH_PROBE " + json.dumps({"ok": ok, "reason": why, "sys_path": sys.path,
                                      "version": version}))
"""
PROBE_TIMEOUT_S = 600.0


def _probe(python: str, name: str, environ: dict) -> tuple[dict | None, str]:
    """Backend ``name`` checked by interpreter ``python`` in a subprocess with ``environ``:
    (its answer: ok, reason, version, sys_path; "") or (None, why asking it failed)."""
    root = str(Path(__file__).resolve().parent.parent)
    try:
        out = subprocess.run([python, "-c", _PROBE, name, root], env=environ,
                             capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"asking {python} failed: {type(e).__name__}: {str(e)[:200]}"
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("QLABENCH_PROBE ")),
                None)
    if out.returncode or line is None:
        code = out.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return None, f"{python} ended with {how}: {' '.join(out.stderr.split())[-300:]}"
    return json.loads(line.split(" ", 1)[1]), ""


def probe_backends(names, env: dict | None = None) -> dict:
    """Backends ``names`` checked each in an interpreter of its own (this one's, with this
    process's environment and ``env``), all at once: name -> [available, reason, version]. What
    a run falls back to when its worker died before reporting (a library whose import kills the
    interpreter is then unavailable alone), and what ``qlabench run --dry-run`` shows."""
    from concurrent.futures import ThreadPoolExecutor
    names = list(dict.fromkeys(names))
    environ = {**os.environ, **(env or {})}

    def one(name):
        got, why = _probe(sys.executable, name, environ)
        if got is None:
            return [False, f"checking {name} in a fresh interpreter failed: {why}", "unavailable"]
        return [bool(got["ok"]), got["reason"], got["version"]]

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return dict(zip(names, pool.map(one, names)))


def worker_environment(entry, environ=None) -> tuple[WorkerEnv | None, tuple[bool, str], str]:
    """(worker environment or None, (available, reason), version) of a
    :class:`~qlabench.config.BackendEntry` that names an environment. ``${VAR}`` is expanded
    here; an unset variable, a missing directory or interpreter, or a backend that is not
    available when asked *in that environment* (a subprocess of that interpreter with that
    ``PYTHONPATH``) make it unavailable, with the reason."""
    from .config import expand
    environ = dict(os.environ if environ is None else environ)

    def no(why: str):
        return None, (False, f"environment of {entry.label}: {why}"), "unavailable"

    python = sys.executable
    if entry.python is not None:
        python, why = expand(entry.python, environ)
        if python is None:
            return no(f"python {entry.python!r}: {why}")
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            src = f" (from {entry.python!r})" if python != entry.python else ""
            return no(f"python {python!r}{src} is not an executable file")
    env = {}
    if entry.pythonpath is not None:
        prefix, why = expand(entry.pythonpath, environ)
        if prefix is None:
            return no(f"pythonpath {entry.pythonpath!r}: {why}")
        dirs = [d for d in prefix.split(os.pathsep) if d]
        bad = [d for d in dirs if not os.path.isdir(d)]
        if bad or not dirs:
            return no(f"pythonpath {entry.pythonpath!r}: no such directory {', '.join(bad) or prefix!r}")
        inherited = environ.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join(dirs + ([inherited] if inherited else []))
    got, why = _probe(python, entry.name, {**environ, **env})
    if got is None:
        return no(why)
    if not got["ok"]:
        return no(got["reason"])
    return (WorkerEnv(entry.label, python, env, tuple(got["sys_path"])), (True, ""),
            got["version"])


@dataclass
class Lane:
    """One backend label of a run on one GPU: its worker and what its check found."""

    label: str
    name: str  # registry name
    probe: object = None  # an entry with an environment of its own: worker_environment's future
    sup: Supervisor | None = None
    avail: tuple | None = None  # (available, reason), once resolved
    version: str | None = None
    report: dict | None = None  # the worker's
    resolved_at: float | None = None  # epoch seconds
    timeouts: int = 0  # its `timeout` rows in a row (Sweep.max_timeouts)


class Lanes:
    """One supervised worker per backend library, all pinned to one GPU (``env``) and started
    together (:meth:`start`; at most one per core of this host at a time, the rest as the first
    report), each importing its own library; labels of one library in this process's
    environment (parameter variants) share its worker, a label with an environment of its own
    has one there. See the module docstring. ``entries``: label ->
    :class:`~qlabench.config.BackendEntry`; ``probes``: label -> the future of
    :func:`worker_environment` for the entries with an environment of their own. With
    ``isolate`` False the labels without an environment of their own are checked and measured
    in this process (:class:`InProcess`)."""

    def __init__(self, sweep, log_dir: Path, log, entries: dict, probes: dict,
                 env: dict | None = None, stop: threading.Event | None = None,
                 isolate: bool = True, per_library: bool = True):
        self.sweep, self.log_dir, self.log, self.env, self.stop = sweep, log_dir, log, env, stop
        self.lanes = {n: Lane(n, e.name, probe=probes[n] if e.own_environment else None)
                      for n, e in entries.items()}
        self.here = None if isolate else InProcess(sweep)
        #: per_library False (a host with few cores): every label of this process's environment
        #: in one worker that imports all their libraries, one after another
        self.per_library = per_library
        self.shared: dict = {}  # registry name (or "" for all) -> the worker its labels share
        self.max_starting = max(1, host_cores())

    def _key(self, lane: Lane) -> str:
        return lane.name if self.per_library else ""

    def _supervisor(self, lane: Lane, worker: WorkerEnv | None = None) -> Supervisor:
        if worker is None and self._key(lane) in self.shared:
            return self.shared[self._key(lane)]
        warm = (lane.name,) if worker is not None or self.per_library else tuple(dict.fromkeys(
            o.name for o in self.lanes.values() if o.probe is None))
        sup = Supervisor(self.sweep, self.log_dir, log=self.log, env=self.env, stop=self.stop,
                         worker=worker, warm=warm,
                         label=lane.label if worker is not None else self._key(lane) or None)
        if worker is None:
            self.shared[self._key(lane)] = sup
        return sup

    def starting(self) -> list[str]:
        """Labels whose worker is importing (started, not resolved), and those still to start."""
        return [n for n, lane in self.lanes.items() if lane.resolved_at is None]

    def _busy(self) -> int:
        return len({id(lane.sup) for lane in self.lanes.values()
                    if lane.sup is not None and lane.resolved_at is None
                    and lane.sup.proc is not None and lane.sup.report is None})

    def start(self) -> None:
        """Every worker of this process's environment starts now, up to one per core (not
        isolated: those labels are checked here, which imports their libraries)."""
        for lane in self.lanes.values():
            if lane.probe is not None or lane.sup is not None or lane.resolved_at is not None:
                continue
            if self.here is not None:
                ok, why, version = check_backend(lane.name)
                self._resolve(lane, (ok, why), version)
            elif self._key(lane) in self.shared or self._busy() < self.max_starting:
                lane.sup = self._supervisor(lane)
                lane.sup.start()

    def _resolve(self, lane: Lane, avail: tuple, version: str) -> None:
        from .config import label_version_problem
        why = label_version_problem(lane.label, version) if avail[0] else ""
        if why:  # the label asks for another version than the one found
            avail, version = (False, why), "unavailable"
        lane.avail, lane.version, lane.resolved_at = (bool(avail[0]), avail[1]), version, time.time()
        sharing = [o for o in self.lanes.values() if lane.sup is not None and o.sup is lane.sup]
        if sharing and all(o.resolved_at is not None and not o.avail[0] for o in sharing):
            lane.sup.close()  # its labels' rows are made here (:meth:`run`)

    def refuse(self, label: str, why: str) -> None:
        """Make a resolved label unavailable (the run's check, on another GPU, said no)."""
        self._resolve(self.lanes[label], (False, why), "unavailable")

    def _advance(self, lane: Lane) -> None:
        if lane.probe is not None and lane.sup is None:  # asked in its environment first
            if not lane.probe.done():
                return
            worker, avail, version = lane.probe.result()
            from .config import label_version_problem
            if worker is None or not avail[0] or label_version_problem(lane.label, version):
                self._resolve(lane, avail, version)
                return
            lane.avail, lane.version = avail, version  # its worker's report resolves it
            lane.sup = self._supervisor(lane, worker)
        if lane.sup is None:
            if self._key(lane) not in self.shared and self._busy() >= self.max_starting:
                return  # its turn comes when a starting worker has reported
            lane.sup = self._supervisor(lane)
        got = lane.sup.poll_ready(0.0)
        if got is None:
            return
        if got:
            lane.report = got
            ok, why, version = got["backends"].get(lane.name, [False, "not in its worker's report",
                                                                "unavailable"])
            if lane.probe is not None and ok:
                version = lane.version  # asked in its environment
            self._resolve(lane, (ok, why), version)
        elif lane.probe is not None:  # its environment said yes: its rows go through fresh workers
            self._resolve(lane, lane.avail, lane.version)
        else:  # each backend of the worker asked in an interpreter of its own, all at once
            sup = lane.sup
            sharing = [o for o in self.lanes.values()
                       if o.sup is sup and o.resolved_at is None and o.probe is None]
            found = probe_backends([o.name for o in sharing], self.env)
            for o in sharing:
                self._resolve(o, (found[o.name][0], found[o.name][1]), found[o.name][2])
            sup.warm = tuple(n for n in sup.warm if found.get(n, [True])[0])  # fresh workers

    def poll(self, wait_s: float = 0.0) -> None:
        """Advance every unresolved label, waiting up to ``wait_s`` for one to resolve
        (:meth:`resolved` says which are)."""
        end = time.monotonic() + wait_s
        before = self.resolved()
        while True:
            for lane in self.lanes.values():
                if lane.resolved_at is None:
                    self._advance(lane)
            now = self.resolved()
            if now != before or time.monotonic() >= end or now == set(self.lanes):
                return
            time.sleep(0.05)

    def resolved(self) -> set:
        return {n for n, lane in self.lanes.items() if lane.resolved_at is not None}

    def run(self, label: str, task, on_row) -> None:
        """``task`` (of ``label`` alone) in the label's worker; an unavailable label's rows are
        made here, with the reason its check gave, and so are a label's rows once its last
        ``Sweep.max_timeouts`` rows were all ``timeout`` (``skipped``, saying so)."""
        lane = self.lanes[label]
        cap = self.sweep.max_timeouts
        if lane.avail[0] and not (cap and lane.timeouts >= cap):
            def counted(row: dict) -> None:
                lane.timeouts = lane.timeouts + 1 if row["status"] == "timeout" else 0
                on_row(row)
            (lane.sup or self.here).run_task(task, counted)
            return
        if not lane.avail[0]:
            status, why = "unavailable", lane.avail[1]
        else:
            status, why = "skipped", (
                f"{label} timed out on its last {lane.timeouts} rows of this run (row_timeout_s="
                f"{self.sweep.row_timeout_s:g}): not run again in it; `--resume` runs these rows")
        for n in task.backends:
            on_row(merge(pinned_row(task, n, self.env), outcome(status, why)))

    def close(self) -> None:
        """End every worker (each one, whatever the others raise)."""
        err = None
        for sup in {id(lane.sup): lane.sup for lane in self.lanes.values() if lane.sup}.values():
            try:
                sup.close()
            except BaseException as e:  # noqa: BLE001 - the others still close
                err = err or e
        if err is not None:
            raise err
