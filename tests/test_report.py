import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest
import synth_results as S
from typer.testing import CliRunner

from qlabench import plots, report, results
from qlabench.cli import app

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Three runs of one config (fwd + bwd; tilelang unavailable): the second makes FLA 10%
    slower, the third makes FlashQLA 10% slower; report rendered once."""
    tmp = tmp_path_factory.mktemp("rep")
    res = S.write_run(tmp / "results" / "synth", directions=("fwd", "bwd"),
                      status={"tilelang": "unavailable"})
    S.copy_scaled(res, res, {"fla": 1.10}, run_id="20250102T000000-bbbbbb",
                  started_at="2025-01-02T00:00:00", git_sha="def456")
    S.copy_scaled(res, res, {"flashqla": 1.10}, run_id="20250103T000000-cccccc",
                  started_at="2025-01-03T00:00:00", git_sha="987fff")
    out = tmp / "site"
    rc = report.report_cmd([res], out)
    assert rc == 0
    return out


def _links(page: str, attr: str) -> list[str]:
    return [unquote(u) for u in re.findall(rf'{attr}="([^"#]+)"', page)]


def test_page_has_figures_history_env_and_parquet_links(site):
    page = (site / "index.html").read_text()
    imgs = _links(page, "src")
    names = {Path(i).name for i in imgs}
    assert {"latency_fwd.png", "latency_bwd.png", "speedup_fwd.png", "latency_vs_tokens_bwd.png",
            "history.png"} <= names
    for i in imgs:  # every image is beside the page and is a real PNG
        p = site / i
        assert p.is_file() and p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000, i
    hrefs = _links(page, "href")
    parts = [h for h in hrefs if h.endswith(".parquet")]
    assert len(parts) == 3 * 48  # every part of every run, linked relatively
    assert all(not h.startswith("/") and (site / h).is_file() for h in parts)
    assert any(h.endswith(".json") and (site / h).is_file() for h in hrefs)
    # history: the FLA step (run 2) and the FlashQLA step (run 3) are the regressions
    assert "16 regression(s)" in page and "latest run has 16 regression(s)" in page
    assert "synth-host" in page and "580.00" in page  # environment from runs/*.json
    assert "unavailable" in page


def test_single_run_has_no_history(tmp_path):
    res = S.write_run(tmp_path / "one")
    assert report.report_cmd([res], tmp_path / "site") == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert "History" not in page and "latency_fwd.png" in page


def test_bad_inputs_exit_2(tmp_path):
    (tmp_path / "empty" / "parts").mkdir(parents=True)
    r = CliRunner().invoke(app, ["report", str(tmp_path / "missing"), "--out", str(tmp_path / "s")])
    assert r.exit_code == 2 and "missing" in r.output and "Traceback" not in r.output
    assert report.report_cmd([tmp_path / "empty"], tmp_path / "s") == 2


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_renders_in_headless_chromium_without_console_errors(site, tmp_path):
    shot = tmp_path / "shot.png"
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
           "--v=0", f"--screenshot={shot}", "--window-size=1400,2000",
           (site / "index.html").resolve().as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    # chromium logs every console message (errors, uncaught exceptions, blocked loads) as CONSOLE
    console = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    import matplotlib.image as mpimg
    img = mpimg.imread(shot)
    assert img.shape[:2] == (2000, 1400)
    rgb = img[..., :3]
    assert (rgb.min(axis=2) < 0.5).mean() > 0.01  # ink on the page: text and figures drawn
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def _committed():
    return sorted(p for p in (ROOT / "results").glob("*") if (p / "parts").is_dir())


@pytest.mark.skipif(not _committed(), reason="no committed runs under results/ yet")
@pytest.mark.parametrize("res", _committed(), ids=lambda p: p.name)
def test_committed_runs_have_figures(res, tmp_path):
    df = results.latest(results.load(res))
    ok = df[df["status"] == "ok"]
    made = plots.run_figures(df, tmp_path)
    assert bool(made) == bool(len(ok)), (res, made)
