"""docs/reliability.md's table is the one scripts/reliability_table.py makes, and every test it names exists."""

from __future__ import annotations

from pathlib import Path

from helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[1]


def _script():
    return load_script("reliability_table")


def test_every_named_test_exists_and_the_doc_table_is_current():
    s = _script()
    cases = s.load_cases()
    ids = sorted({t for c in cases for t in c.tests})
    have = s.collected(sorted({t.split("::")[0] for t in ids}))
    assert [t for t in ids if t not in have] == []
    assert "tests/test_bridge_edges.py::no_such_test" not in have  # the check can fail
    doc = (REPO / "docs" / "reliability.md").read_text()
    assert f"{s.BEGIN}\n{s.table(cases, None)}\n{s.END}" in doc, "run: python scripts/reliability_table.py --write"
    assert {c.status for c in cases} <= {"fixed", "partial", "open"}


def test_outside_the_venv_it_says_so_in_one_line(tmp_path):
    """issue 53 item 8: ``python scripts/reliability_table.py`` with an interpreter that is not the project's
    venv (here a fresh venv of the same Python, without pytest or foursight) stops with one line saying
    which venv to use, exit status 2 (before: 94 false "missing test" lines, one per named test)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    r = subprocess.run([str(tmp_path / "bare" / "bin" / "python"), "scripts/reliability_table.py"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(out) == 1, (r.returncode, out[:5])
    assert ".venv/bin/python scripts/reliability_table.py" in out[0] and "missing test" not in out[0], out
