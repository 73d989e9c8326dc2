#!/usr/bin/env python3
"""Mutation check: does the test suite fail when the code breaks in these ways?

Each entry of :data:`MUTATIONS` is a file (relative to the repository root), an exact snippet of
it, the snippet that replaces it, what the replacement breaks, and the pytest node ids that must
fail under it. For each entry the script replaces the snippet in the file in place (it must
occur exactly once), runs ``python3 -m pytest -q -x -p no:cacheprovider <ids>`` from the
repository root (``PYTHONPATH`` starting with that root, so the tree under test is the one
imported), records ``killed`` (the tests failed, did not import, or ran past ``--timeout``)
or ``survived`` (they passed), and puts the file back — always: in a ``finally``, on Ctrl-C and SIGTERM too. The
file is put back by replacing the mutated snippet with the original one, so an edit made
elsewhere in the file meanwhile is kept; where the mutated snippet is no longer there once, the
whole original text is written back. Before the mutations, the listed tests run once on the
unmutated tree (``--no-baseline`` skips it): a test that fails there would kill every mutation
and prove nothing.

It prints a table and exits 0 when every mutation was killed, 1 when any survived, 2 when an
entry is bad (snippet not found exactly once, unknown ``--only`` name, node ids pytest does not
run) or the baseline fails, 130 when interrupted.

Not part of the test run (each entry runs its tests once: minutes). By hand, from anywhere:

    python3 scripts/mutation_check.py                 # every mutation
    python3 scripts/mutation_check.py --only NAME     # one (repeat --only, or NAME,NAME)
    python3 scripts/mutation_check.py --list          # the entries

It edits the tree it lives in while it runs: where others use that tree at the same time, run a
copy of it (``cp -r`` of the repository, then ``python3 COPY/scripts/mutation_check.py``).

Adding one is an entry of :data:`MUTATIONS`: name, file, original snippet, mutated snippet, what
it breaks, the node ids that must catch it::

    M("NAME", "qlabench/FILE.py",
      "exact original snippet", "the mutated snippet",
      "what the mutation breaks, in words",
      ["tests/test_FILE.py::test_NAME"]),
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class M(NamedTuple):
    name: str
    file: str  # relative to the repository root
    original: str  # occurs exactly once in the file
    mutated: str
    breaks: str  # what the mutation breaks, in words
    tests: list[str]  # pytest node ids of which at least one must fail


MUTATIONS: list[M] = [
    M("no-poison-of-preallocated-outputs", "qlabench/correctness.py",
      "    poison.fill_nan(prep.outputs)\n", "",
      "a checked call sees the preallocated outputs as the last call left them",
      ["tests/test_poison.py::test_checked_call_poisons_preallocated_outputs"]),
    M("timed-path-check-ignored", "qlabench/measure.py",
      "            if chk.bad:\n", "            if False:\n",
      "measure ignores the check of the timed path on fresh inputs",
      ["tests/test_correctness_adversarial.py::test_lazy_backends_are_caught_on_the_timed_path"]),
    M("timed-path-on-the-checked-inputs", "qlabench/correctness.py",
      "        t.data.copy_(new)\n", "        pass\n",
      "the timed path is checked on the inputs it was timed on (a cached answer passes)",
      ["tests/test_poison.py::test_timed_path_check_runs_on_fresh_inputs_and_checks_every_call",
       "tests/test_correctness_adversarial.py::test_noise_of_a_bf16_kernel_passes_every_output"]),
    M("timed-path-checks-one-call", "qlabench/correctness.py",
      "    for i, raw in enumerate(raws):\n", "    for i, raw in enumerate(raws[-1:]):\n",
      "only the last unrolled call of the timed graph is checked",
      ["tests/test_poison.py::test_timed_path_check_runs_on_fresh_inputs_and_checks_every_call"]),
    M("marginal-cost-of-one-replay", "qlabench/timing.py",
      "    return (n * per_call - statistics.median(one)) / (n - 1) / per_call\n",
      "    return n * per_call / statistics.median(one)\n",
      "the marginal cost compares a replay with a replay, blind to n calls doing one's work",
      ["tests/test_poison.py::test_marginal_ratio_tells_n_calls_from_the_work_of_one"]),
    M("local-check-against-own-norm", "qlabench/correctness.py",
      "    return _worst_rel(unit_d2 / (unit_tok[:, None] * D), torch.maximum(base * allow[:, None] ** 2, sens))\n",
      "    unit_r2 = torch.zeros(nu, H, dtype=torch.float64, device=a.device).index_add_(0, unit, r2t)\n"
      "    return _worst_rel(unit_d2, unit_r2)\n",
      "a chunk is judged against its own norm (a one-token sequence against one scalar)",
      ["tests/test_correctness.py::test_a_one_token_sequence_is_judged_against_its_sequence_scale_not_its_own_norm"]),
    M("no-spread-allowance", "qlabench/correctness.py",
      "torch.maximum(base * allow[:, None] ** 2, sens))", "torch.maximum(base, sens))",
      "a unit of one scalar (a one-token sequence's dbeta) is judged as a 64-token chunk's RMS: a "
      "correct kernel that rounds elsewhere than the twin is `incorrect`",
      ["tests/test_correctness.py::test_one_token_gradients_of_a_kernel_that_rounds_elsewhere_pass"]),
    M("spread-allowance-on-the-twin", "qlabench/correctness.py",
      "torch.maximum(base * allow[:, None] ** 2, sens))", "torch.maximum(base, sens) * allow[:, None] ** 2)",
      "the allowance for few scalars also widens the twin's sensitivity, itself one draw per scalar: "
      "a one-token sequence's dg or dbeta 60% off passes",
      ["tests/test_correctness.py::test_one_token_gradients_of_a_kernel_that_rounds_elsewhere_pass"]),
    M("no-rounding-allowance", "qlabench/correctness.py",
      "    if rounded is not None:\n        c = rounded", "    if False:\n        c = rounded",
      "the local check ignores the reference's bf16-rounding sensitivity: a correct kernel's "
      "gradient of a one-token sequence is called incorrect",
      ["tests/test_correctness.py::test_one_token_gradients_of_a_correct_bf16_kernel_pass"]),
    M("marginal-ratio-ignored", "qlabench/measure.py",
      "    if tr.marginal_ratio is not None and not tr.marginal_ratio >= MIN_MARGINAL_RATIO:\n",
      "    if False:\n",
      "measure ignores a timed graph whose unrolled calls cost about as much as one",
      ["tests/test_correctness_adversarial.py::test_a_timed_graph_whose_calls_do_the_work_of_one_is_incorrect"]),
    M("no-chunk-check", "qlabench/correctness.py",
      "             token_local_err(out, ref, cu_seqlens, rounded, name in HEAD_FLOOR_OUTPUTS), CHUNK_FACTOR)]\n",
      "             0.0, CHUNK_FACTOR)]\n",
      "the chunk check is skipped: one wrong chunk or token passes",
      ["tests/test_correctness_adversarial.py::test_one_wrong_token_or_chunk_in_a_long_sequence_is_incorrect"]),
    M("rerun-cost-ignored", "qlabench/measure.py",
      "    if chk.rerun_ms is None or not chk.calls:\n        return \"\"", "    if True:\n        return \"\"",
      "the time of the timed path's rerun on fresh inputs is not held against the timed samples "
      "(an answer cached against a fingerprint of the inputs passes)",
      ["tests/test_correctness_adversarial.py::test_work_skipped_by_the_timed_calls_is_incorrect[fwd-input-watch]",
       "tests/test_correctness_adversarial.py::test_work_skipped_by_the_timed_calls_is_incorrect[fwd-lazy-after-refresh]"]),
    M("rerun-of-the-sample-loop-untimed", "qlabench/timing.py",
      '        return [last.pop("out")], ms\n', '        return [last.pop("out")], 0.0\n',
      "the events / cpu rerun reports no time: a call that computes only on unseen inputs passes",
      ["tests/test_correctness_adversarial.py::test_work_skipped_by_the_timed_calls_is_incorrect[fwd-input-watch]"]),
    M("refresh-untimed", "qlabench/correctness.py",
      "            _, refresh_ms = clock(prep.refresh)\n", "            prep.refresh()\n",
      "Prepared.refresh runs untimed (refresh_ms null: the row no longer says what refresh cost)",
      ["tests/test_poison.py::test_refresh_is_timed_with_the_clock_given_after_the_fresh_values_are_written"]),
    M("one-slow-rerun-fails-the-row", "qlabench/measure.py",
      "            if attempt == FRESH_SETS - 1:\n", "            if attempt >= 0:\n",
      "a cost that does not fit fails the row without a second set of fresh inputs (one host "
      "hiccup makes an honest row `incorrect`)",
      ["tests/test_correctness_adversarial.py::test_costs_that_do_not_fit_are_confirmed_on_a_second_fresh_set"]),
    M("no-global-allowance-for-rounding", "qlabench/correctness.py",
      "            lim = max(lim, LIMIT_MARGIN * rel_err(rounded, ref[n])[0])\n",
      "            pass\n",
      "the global limit ignores what a correct bf16 kernel is off by on the point (one to three "
      "tokens: a correct kernel's dbeta / dg is `incorrect`)",
      ["tests/test_correctness.py::test_a_correct_bf16_kernel_passes_the_smallest_layouts"]),
    M("head-floor-on-every-output", "qlabench/correctness.py",
      "rounded, name in HEAD_FLOOR_OUTPUTS)", "rounded, True)",
      "every token output's local scale is floored at the head's RMS (a short sequence's o 20% "
      "off beside long ones passes)",
      ["tests/test_correctness.py::test_a_short_sequence_beside_long_ones_is_judged_by_its_own_scale"]),
    M("layout-read-from-the-backends-inputs", "qlabench/correctness.py",
      '    cu, want_ht = getattr(ref, "layout", None) or (x.cu_seqlens, x.output_final_state)\n',
      "    cu, want_ht = x.cu_seqlens, x.output_final_state\n",
      "the check reads the layout and whether a final state is wanted from the inputs the backend "
      "holds (one that turns output_final_state off returns any final state)",
      ["tests/test_correctness_adversarial.py::test_a_backend_cannot_change_what_is_checked"]),
    M("no-re-timing-before-a-further-set", "qlabench/measure.py",
      "            tr, timed, why = time_it()\n            if why:\n                return failed(why)\n        if len(seeds)",
      "            why = \"\"\n            if why:\n                return failed(why)\n        if len(seeds)",
      "a further fresh set's costs are held against the first samples, not the point's own inputs "
      "timed again (a machine slowed by load since the samples fails honest rows; a backend lazy "
      "until its inputs change keeps its lazy latency)",
      ["tests/test_correctness_adversarial.py::test_a_machine_slowed_from_the_check_on_moves_both_sides",
       "tests/test_correctness_adversarial.py::test_lazy_until_its_inputs_change_is_timed_at_its_honest_cost"]),
    M("re-timed-on-seen-fresh-inputs", "qlabench/measure.py",
      "            refill(x, own())\n            if prep.refresh", "            pass\n            if prep.refresh",
      "the path is timed again on the fresh inputs it has just seen, not the point's own: an answer "
      "precomputed for the timed inputs passes",
      ["tests/test_correctness_adversarial.py::test_an_answer_precomputed_for_the_timed_inputs_is_incorrect"]),
    M("graph-rerun-returns-last-call", "qlabench/timing.py",
      "                return list(captured), ms\n", "                return list(captured)[-1:], ms\n",
      "the timed graph's rerun hands over only its last unrolled call's outputs",
      ["tests/test_timing_graph.py::test_rerun_replays_the_graph_and_returns_every_unrolled_call",
       "tests/test_timing_graph.py::test_the_timed_path_check_sees_every_unrolled_call_of_the_graph"]),
    M("call-after-timing-ignored", "qlabench/measure.py",
      "    if bad2:\n", "    if False:\n",
      "the poisoned eager call after the timed path's check is not gated (state carried between "
      "calls passes)",
      ["tests/test_correctness_adversarial.py::test_a_call_after_the_timed_path_check_is_checked"]),
    M("resume-retries-incorrect", "qlabench/results.py",
      'RETRY_STATUSES = ("unavailable", "skipped")',
      'RETRY_STATUSES = ("unavailable", "skipped", "incorrect")',
      "--resume measures `incorrect` rows again (until they pass) instead of keeping them",
      ["tests/test_results.py::test_resume_does_not_measure_incorrect_rows_again"]),
    M("timeouts-never-skip", "qlabench/supervisor.py",
      "if lane.avail[0] and not (cap and lane.timeouts >= cap):", "if lane.avail[0]:",
      "a backend that times out on every row is tried on every row (each costing row_timeout_s)",
      ["tests/test_faults.py::test_a_backend_that_keeps_timing_out_is_skipped_for_the_rest_of_the_run"]),
    M("resume-key-without-version", "qlabench/results.py",
      "return (point_key, backend, direction, backend_version, backend_params)",
      "return (point_key, backend, direction, backend_params)",
      "the resume key ignores backend_version: rows of another version count as done",
      ["tests/test_results.py::test_resume_measures_rows_of_another_backend_version_again"]),
    M("held-out-point-not-held-out", "qlabench/dispatch.py",
      "rest = [q for i, q in enumerate(pts) if i not in out]",
      "rest = list(pts)",
      "the held-out figures judge each point with a table built from it too",
      ["tests/test_dispatch.py::test_held_out_point_is_left_out_of_the_table_that_judges_it",
       "tests/test_dispatch.py::test_leave_one_head_config_out_judges_each_with_a_table_built_without_it"]),
    M("out-dir-any-sweep", "qlabench/runner.py",
      'sw = sw[sw["sweep"] != sweep.name]', 'sw = sw.iloc[:0]',
      "run adds rows to a directory of another sweep",
      ["tests/test_out_dir.py::test_another_sweep_is_refused_unless_append_other"]),
    M("out-dir-any-gpu", "qlabench/runner.py",
      'gpus = gpus[gpus["gpu_name"] != gpu_name]["gpu_name"].value_counts()',
      'gpus = gpus.iloc[:0]["gpu_name"].value_counts()',
      "run adds rows to a directory of rows measured on another GPU",
      ["tests/test_out_dir.py::test_another_gpu_is_refused_unless_append_other"]),
    M("out-dir-any-recipe", "qlabench/runner.py",
      "bad = rec[[h != mine[k].recipe_hash", "bad = rec[[False and h != mine[k].recipe_hash",
      "run (and --resume) adds rows of another input recipe under the same point keys",
      ["tests/test_out_dir.py::test_another_input_recipe_is_refused_unless_append_other",
       "tests/test_results.py::test_resume_refuses_changed_recipe"]),
    M("out-dir-append-other-resumes-any-recipe", "qlabench/runner.py",
      'if not append_other or (k in RESUME_NEVER_MIXES and resume)}', "if not append_other}",
      "--resume --append-other resumes over rows of another input recipe (their keys count as done)",
      ["tests/test_out_dir.py::test_another_input_recipe_is_refused_unless_append_other"]),
    M("out-dir-refusal-keeps-worker-logs", "qlabench/runner.py",
      "    ex.discard_logs()\n    never = ",
      "    never = ",
      "a refused run leaves its workers' logs in the other sweep's directory",
      ["tests/test_out_dir.py::test_another_gpu_is_refused_unless_append_other"]),
]


def check(m: M) -> str:
    """The file's text; SystemExit(2) unless the original snippet occurs in it exactly once."""
    path = ROOT / m.file
    if not path.is_file():
        sys.exit(f"{m.name}: no file {m.file}")
    text = path.read_text()
    n = text.count(m.original)
    if n != 1:
        sys.exit(f"{m.name}: the original snippet occurs {n} times in {m.file} (expected once):\n"
                 f"{m.original}")
    return text


def pytest(ids: list[str], timeout: float) -> tuple[int | None, float, str]:
    """Run the node ids; (exit status, or None past ``timeout``; seconds; output tail). The
    tests run in a session of their own, ended as a group past the timeout or on Ctrl-C."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             *ids], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        out, rc = "", None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, time.time() - t0, (out or "").strip()[-2000:]


def restore(m: M, original_text: str) -> None:
    path = ROOT / m.file
    now = path.read_text()
    if now == original_text:
        return
    if now.count(m.mutated) == 1 and now.count(m.original) == 0:
        path.write_text(now.replace(m.mutated, m.original))  # keeps edits made elsewhere meanwhile
    else:
        path.write_text(original_text)


def run_one(m: M, timeout: float) -> tuple[str, float, str]:
    text = check(m)
    try:
        (ROOT / m.file).write_text(text.replace(m.original, m.mutated))
        rc, secs, out = pytest(m.tests, timeout)
    finally:
        restore(m, text)
    if rc is None:
        return "killed (timeout)", secs, out
    if rc == 0:
        return "survived", secs, out
    if rc == 1:
        return "killed", secs, out
    if rc == 2:  # the mutated tree did not import (collection error)
        return "killed (import)", secs, out
    return f"error (pytest exit {rc})", secs, out  # 4: usage error, 5: no tests collected


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this mutation (repeatable; or NAME,NAME)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds per pytest run; past it the mutation counts as killed")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the run of the listed tests on the unmutated tree")
    ap.add_argument("--show", action="store_true",
                    help="print the end of each mutation's pytest output (what failed, and how)")
    a = ap.parse_args(argv)

    def interrupted(signum, frame):  # SIGTERM ends the run like Ctrl-C: the file is put back
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    if a.list:
        for m in MUTATIONS:
            print(f"{m.name:<42} {m.file:<24} {m.breaks}")
        return 0
    want = [n for o in a.only for n in o.split(",") if n]
    names = {m.name for m in MUTATIONS}
    if len(names) != len(MUTATIONS):
        print("error: two mutations share a name", file=sys.stderr)
        return 2
    unknown = [n for n in want if n not in names]
    if unknown:
        print(f"error: --only {', '.join(unknown)}: no such mutation (--list)", file=sys.stderr)
        return 2
    todo = [m for m in MUTATIONS if not want or m.name in want]
    for m in todo:
        check(m)
    results = []
    try:
        if not a.no_baseline:
            ids = list(dict.fromkeys(t for m in todo for t in m.tests))
            rc, secs, out = pytest(ids, a.timeout)
            if rc != 0:
                print(f"{out}\nerror: the listed tests do not pass on the unmutated tree (pytest "
                      f"exit {rc}, {secs:.0f} s): fix them first", file=sys.stderr)
                return 2
            print(f"baseline: {len(ids)} tests pass unmutated ({secs:.0f} s)", flush=True)
        for m in todo:
            verdict, secs, out = run_one(m, a.timeout)
            results.append((m, verdict, secs))
            print(f"{m.name}: {verdict} ({secs:.0f} s)", flush=True)
            if a.show or verdict.startswith("error"):
                print("    " + "\n    ".join(out.splitlines()[-25:]), flush=True)
    except KeyboardInterrupt:
        print("interrupted: no file is left mutated", file=sys.stderr)
        return 130
    w = max(len(m.name) for m, _, _ in results)
    print(f"\n{'mutation':<{w}}  {'result':<16} {'s':>5}  file: what it breaks")
    for m, verdict, secs in results:
        print(f"{m.name:<{w}}  {verdict:<16} {secs:5.0f}  {m.file}: {m.breaks}")
    survived = [m.name for m, v, _ in results if v == "survived"]
    errors = [m.name for m, v, _ in results if v.startswith("error")]
    print(f"\n{len(results) - len(survived) - len(errors)} killed, {len(survived)} survived"
          + (f", {len(errors)} errors" if errors else "")
          + (f": {', '.join(survived + errors)}" if survived or errors else ""))
    return 1 if survived else 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
