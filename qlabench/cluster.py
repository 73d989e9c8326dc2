"""Sweeps beyond one host: a Slurm job array through submitit, one GPU per job.

Why submitit: a sweep is an embarrassingly parallel list of shards whose results are plain
files on a shared filesystem; teams running H200 clusters schedule with Slurm, and submitit
is the maintained, dependency-light way to submit Python callables as Slurm job arrays (with
``local`` and ``debug`` executors that run the same code path on one machine, which is how CI
tests it). Ray would need a long-lived cluster and an object store we do not use.

Each job runs ``qlabench run CONFIG --shard i/n`` into ``OUT/_shards/shard-i`` (deterministic
shards, ``--resume`` so a requeued job continues), and the submitting process merges the shards
into ``OUT`` with :func:`qlabench.results.merge` once they finish. submitit's own files go to
``OUT/_submitit``; both names start with ``_``, so ``pandas.read_parquet(OUT)`` reads the merged
rows only.

``--executor slurm`` (the default) needs Slurm (``sbatch`` on ``PATH``): without it
:func:`submit_sweep` fails (exit 2) instead of letting submitit fall back to running the jobs
locally; ``--executor local`` runs the shards on this machine on purpose.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .results import SHARDS_DIR

SUBMITIT_DIR = "_submitit"


class NoSlurm(Exception):
    """``--executor slurm`` on a machine without Slurm."""


def slurm_available() -> bool:
    return shutil.which("sbatch") is not None


def shard_job(config_path: str, i: int, n: int, out_dir: str, resume: bool) -> dict:
    """One job: shard i of n of the sweep, written into its own directory."""
    from . import config, runner
    s = config.load(config_path)
    summ = runner.run(s, out_dir, config_name=config_path, shard=(i, n), resume=resume,
                      log=lambda m: print(m, flush=True))
    return summ.counts


def make_executor(kind: str, folder: Path, partition: str | None, timeout_min: int, n: int):
    import submitit
    if kind == "slurm":
        if not slurm_available():
            raise NoSlurm("Slurm is not available here (no `sbatch` on PATH), so no job was "
                          "submitted; run `qlabench submit` on a Slurm login node, or pass "
                          "--executor local to run the shards on this machine")
        # cluster="slurm": never submitit's automatic fallback to local jobs
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
        params = dict(timeout_min=timeout_min, gpus_per_node=1, tasks_per_node=1, cpus_per_task=8,
                      slurm_array_parallelism=n, name="qlabench")
        if partition:
            params["slurm_partition"] = partition
        ex.update_parameters(**params)
        return ex
    if kind == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=timeout_min)
        return ex
    if kind == "debug":
        return submitit.DebugExecutor(folder=folder)
    raise ValueError(f"--executor {kind!r}: expected slurm, local or debug")


def submit_sweep(sweep, config_path, shards: int, out: Path, executor: str, partition, timeout_min,
                 resume: bool, console, err) -> int:
    from .results import MergeError, merge
    try:
        import submitit  # noqa: F401
    except ImportError:
        err.print("error: `qlabench submit` needs submitit (pip install submitit)", highlight=False)
        return 2
    out = Path(out).resolve()
    try:
        ex = make_executor(executor, out / SUBMITIT_DIR, partition, timeout_min, shards)
    except (ValueError, NoSlurm) as e:
        err.print(f"error: {e}", highlight=False)
        return 2
    cfg = str(Path(config_path).resolve())
    dirs = [str(out / SHARDS_DIR / f"shard-{i}") for i in range(shards)]
    jobs = ex.map_array(shard_job, [cfg] * shards, list(range(shards)), [shards] * shards, dirs,
                        [resume] * shards)
    console.print(f"submitted {len(jobs)} jobs ({executor}): {[j.job_id for j in jobs]}")
    failed = 0
    for i, j in enumerate(jobs):
        try:
            counts = j.result()
            console.print(f"shard {i}/{shards}: {counts}")
        except Exception as e:  # a failed shard keeps what it wrote; the merge says what is there
            failed += 1
            err.print(f"shard {i}/{shards} failed: {type(e).__name__}: {str(e)[:300]}", highlight=False)
    present = [d for d in dirs if (Path(d) / "parts").is_dir()]
    try:
        c = merge(out, present, force=True)  # OUT is this submission's own (a resubmit adds to it)
    except MergeError as e:
        err.print(f"error: {e}", highlight=False)
        return 2
    console.print(f"merged {len(present)} shards -> {out}: {c['rows']} rows")
    return 1 if failed else 0
