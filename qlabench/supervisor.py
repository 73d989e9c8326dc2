"""Crash isolation: points run in a worker process that the main process supervises.

The worker (``multiprocessing`` spawn context, so CUDA is never forked) receives one
:class:`~qlabench.runner.Task` at a time and sends back ``("start", backend)`` before each backend
and ``("row", row)`` after it; the main process writes each row durably. If the worker dies
(illegal address, abort, segfault), the backend in flight gets a ``crashed`` row with the tail of
the worker's stderr log; if a backend runs past ``row_timeout_s`` the worker is killed and the row
says ``timeout``. A fresh worker then goes on with the remaining backends. Compile caches that live
on disk (TileLang, Triton, FlashInfer JIT) survive worker restarts.

SIGINT/SIGTERM in the main process never interrupt a row write (:func:`deferred_signals`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from pathlib import Path

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
    def to_kbi(signum, frame):
        raise KeyboardInterrupt
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, to_kbi)


class InProcess:
    """No isolation (debugging, tests of the measuring path itself)."""

    def __init__(self, sweep):
        self.sweep = sweep

    def run_task(self, task, on_row) -> None:
        from .runner import measure_task

        def emit(kind, payload):
            if kind == "row":
                on_row(payload)
        measure_task(self.sweep, task, emit)

    def close(self) -> None:
        pass


def _worker_main(conn, sweep_json: dict, log_path: str, env: dict | None = None) -> None:
    os.environ.update(env or {})  # before torch is imported: pins the worker's GPU
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    faulthandler.enable(file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # stack on timeout
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    from .config import Sweep
    from .runner import measure_task
    sweep = Sweep.model_validate(sweep_json)
    while True:
        task = conn.recv()
        if task is None:
            break
        print(f"--- task {task.point.describe()} {task.direction} {task.backends}",
              file=sys.stderr, flush=True)
        measure_task(sweep, task, lambda kind, payload: conn.send((kind, payload)))
        conn.send(("done", None))


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


class Supervisor:
    def __init__(self, sweep, log_dir: Path, log=print, poll_s: float = 0.2,
                 env: dict | None = None, stop: threading.Event | None = None):
        self.sweep = sweep
        self.stop = stop  # set: return after the row in flight (the worker is then ended)
        self.env = dict(env or {})
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.poll_s = poll_s
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.conn = None
        self.n_started = 0
        if threading.current_thread() is threading.main_thread():
            install_sigterm_as_interrupt()

    def _start(self) -> None:
        self.n_started += 1
        tag = self.env.get("QLABENCH_GPU_INDEX", "")
        self.log_path = self.log_dir / f"worker-{os.getpid()}{'-gpu' + tag if tag else ''}-{self.n_started}.log"
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(
            target=_worker_main, args=(child, self.sweep.model_dump(mode="json"),
                                       str(self.log_path), self.env), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def _kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(timeout=10)
        self.proc = None
        self.conn = None

    def run_task(self, task, on_row) -> None:
        from .runner import Task, row_for, uuid_of
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
                    ready = self.conn.poll(self.poll_s)
                except (EOFError, OSError):
                    ready = False
                if ready:
                    try:
                        kind, payload = self.conn.recv()
                    except (EOFError, OSError):
                        failure = "crashed"
                        break
                    if kind == "start":
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
                if not self.proc.is_alive():
                    failure = "crashed"
                    break
                if time.monotonic() > deadline:
                    failure = "timeout"
                    break
            # the worker died or hung on `current`
            if failure == "crashed" and self.proc is not None:
                self.proc.join(timeout=5)
            if failure == "timeout" and self.proc is not None and self.proc.is_alive():
                with contextlib.suppress(Exception):
                    os.kill(self.proc.pid, signal.SIGUSR1)  # where was it stuck? -> its log
                    time.sleep(1.0)
            code = self.proc.exitcode if self.proc is not None else None
            self._kill()
            if current is None:  # died between backends (e.g. during cleanup): no row to blame
                idle_deaths += 1
                self.log(f"worker {failure} between backends on {task.point.describe()}; restarting")
                if not remaining:
                    return
                if idle_deaths < 2:
                    continue
                current = remaining[0]  # it keeps dying before this backend starts: blame it
            row = row_for(task, current)
            pinned = self.env.get("QLABENCH_GPU_INDEX")
            if pinned is not None:  # the worker's GPU, not this process's
                row.update(gpu_index=int(pinned), gpu_uuid=uuid_of(int(pinned)))
            if failure == "timeout":
                reason = (f"no result within row_timeout_s={self.sweep.row_timeout_s:g}; worker "
                          f"killed | stack: {_stack(self.log_path)}")
            else:
                sig = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                reason = f"worker died ({sig}) | log tail: {_tail(self.log_path)}"
            row.update(status=failure, reason=reason)
            self.log(f"worker {failure} on {task.point.describe()} {task.direction} {current}; "
                     "starting a fresh worker")
            on_row(row)
            if current in remaining:
                remaining.remove(current)

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(timeout=5)
            except Exception:
                pass
        self._kill()
