"""The device drivers under scripts/: they run only on a lent GPU machine, so a syntax error or an
undocumented job step would first show there, at the cost of device time."""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").rglob("*.sh"))
CAMPAIGN = ROOT / "scripts" / "airgapped" / "h200_campaign.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_scripts_parse(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_campaign_steps_are_documented():
    """Every step the job runs (``step NAME ...``; NAME_resume continues NAME) is described in the
    script's header, where JOB_STEPS users look them up, and the header names no step that is gone."""
    text = CAMPAIGN.read_text()
    header = text.split("\nset -uo pipefail", 1)[0]
    run = {re.sub(r"_resume$", "", n) for n in re.findall(r"(?:^|&&)\s*step ([a-z0-9_]+) ", text, re.M)}
    documented = set(re.findall(r"^#   ([a-z0-9_]+) ", header, re.M)) - {"step"}
    assert run, "no step found: the pattern no longer matches the script"
    assert run - documented == set(), f"steps run but not described in the header: {sorted(run - documented)}"
    assert documented - run == set(), f"steps described but never run: {sorted(documented - run)}"
