"""The dashboard as a person opens it: the winner map and the per-model speedup figure are on the
page, every figure is at most ``plots.MAX_WIDTH_PX`` wide with no text under ``plots.MIN_FONT_PT``,
and headless Chromium loads every image of it without a console error.

Chromium: ``chromium``, ``chromium-browser``, ``google-chrome`` or a Playwright download; without
one the browser test skips, unless ``CI=true`` or ``QLABENCH_REQUIRE_CHROMIUM=1`` (then it fails:
CI installs Debian's ``chromium``)."""

import glob
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest
import synth_results as S
from PIL import Image

from qlabench import plots, report

BACKENDS = ("fla", "flashinfer", "flashqla", "tilelang")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if p := shutil.which(name):
            return p
    home = os.path.expanduser(os.environ.get("PLAYWRIGHT_BROWSERS_PATH", "~/.cache/ms-playwright"))
    found = sorted(glob.glob(f"{home}/chromium-*/chrome-linux*/chrome")
                   + glob.glob(f"{home}/chromium_headless_shell-*/chrome-linux*/headless_shell"))
    return found[-1] if found else None


def _need_chromium() -> str:
    exe = find_chromium()
    if exe:
        return exe
    msg = ("no Chromium (chromium, chromium-browser, google-chrome or Playwright's): "
           "apt-get install chromium")
    if os.environ.get("CI") == "true" or os.environ.get("QLABENCH_REQUIRE_CHROMIUM") == "1":
        pytest.fail(msg + " — required under CI=true / QLABENCH_REQUIRE_CHROMIUM=1")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Two runs (fwd + bwd, four backends incl. FlashInfer); the second makes tilelang 10%
    slower (in-repo kernel history, no library regression)."""
    tmp = tmp_path_factory.mktemp("dash")
    res = S.write_run(tmp / "results" / "synth", directions=("fwd", "bwd"), backends=BACKENDS)
    S.copy_scaled(res, res, {"tilelang": 1.10}, run_id="20250102T000000-bbbbbb",
                  started_at="2025-01-02T00:00:00", git_sha="def456")
    out = tmp / "site"
    assert report.report_cmd([res], out) == 0
    return out


def _imgs(page: str) -> list[dict]:
    return [dict(re.findall(r'(\w+)="([^"]*)"', tag)) for tag in re.findall(r"<img [^>]*>", page)]


def test_page_has_winner_map_and_speedup_figures_of_readable_size(site):
    page = (site / "index.html").read_text()
    imgs = _imgs(page)
    classes = [i.get("class", "") for i in imgs]
    assert sum("winner-map" in c for c in classes) == 2  # fwd and bwd
    assert sum(c.split()[-1] == "speedup" for c in classes) == 2
    assert "Who wins (latest rows)" in page and "In-repo kernel history (tilelang)" in page
    assert "banner bad" not in page
    for i in imgs:
        p = site / unquote(i["src"])
        with Image.open(p) as im:
            w, h = im.size
            meta = im.text
        assert w <= plots.MAX_WIDTH_PX, (p.name, w)
        assert (int(i["width"]), int(i["height"])) == (w, h), p.name
        assert float(meta[plots.META_MIN_FONT]) >= plots.MIN_FONT_PT, (p.name, meta)
        assert int(meta[plots.META_DPI]) >= 100, (p.name, meta)


def test_winner_table_follows_the_layout_order(site):
    page = (site / "index.html").read_text()
    fwd = page.split("fwd: winner per point", 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>([^<]*)</td><td>[^<]*</td><td>([^<]*)</td>", fwd)
    first_model = [lay for m, lay in rows if m == rows[0][0]]
    # sequences, then tokens: 1 × 8192, 1 × 32768, 2 × 4096, 8 × 1024
    want = [S.layout_label(s) for s in ([8192], [32768], [4096, 4096], [1024] * 8)]
    assert first_model == want


PROBE = """<script>
window.addEventListener('load', () => {
  const out = [...document.images].map(i => ({id: i.id, cls: i.className, complete: i.complete,
    w: i.naturalWidth, h: i.naturalHeight, shown: i.getBoundingClientRect().width}));
  const pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify({imgs: out, page: document.documentElement.clientWidth});
  document.body.appendChild(pre);
});
</script></body>"""


def _chromium(exe: str, url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           "--window-size=1400,2000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_headless_chromium_loads_every_figure(site, tmp_path):
    exe = _need_chromium()
    page = (site / "index.html").read_text()
    probe = site / "probe.html"  # the page plus a script that reports what the browser loaded
    probe.write_text(page.replace("</body>", PROBE))
    r = _chromium(exe, probe.resolve().as_uri(), tmp_path / "profile", "--dump-dom",
                  "--virtual-time-budget=15000")
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', r.stdout, re.S)
    assert m, r.stdout[-2000:]
    got = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    imgs = got["imgs"]
    assert len(imgs) == len(_imgs(page)) >= 6
    assert any("winner-map" in i["cls"] for i in imgs)
    assert any(i["cls"].split()[-1] == "speedup" for i in imgs)
    for i in imgs:  # decoded by the browser, at most 2000 px, never wider than the page
        assert i["complete"] and 0 < i["w"] <= plots.MAX_WIDTH_PX, i
        assert i["shown"] <= got["page"] + 1, (i, got["page"])
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def test_renders_in_headless_chromium_without_console_errors(site, tmp_path):
    exe = _need_chromium()
    shot = tmp_path / "shot.png"
    r = _chromium(exe, (site / "index.html").resolve().as_uri(), tmp_path / "profile",
                  f"--screenshot={shot}")
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
