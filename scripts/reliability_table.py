#!/usr/bin/env python
"""The table of docs/reliability.md, from tests/reliability_cases.py.

    python scripts/reliability_table.py            # check every named test exists, print the table
    python scripts/reliability_table.py --run      # also run them (vLLM ones included: minutes) and add the outcome
    python scripts/reliability_table.py --write    # put the table into docs/reliability.md (between the markers)

Exit status 1 when a named test does not exist or (with --run) did not pass; 2, with one line saying so,
when this interpreter cannot run the project's tests (outside the project's venv) or pytest cannot
collect them.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability-table:begin (scripts/reliability_table.py --write) -->", "<!-- reliability-table:end -->"


def check_interpreter() -> None:
    """Stop with one plain line unless this interpreter has pytest and foursight (the project's venv): the
    table is checked by collecting the tests with ``sys.executable -m pytest``, and outside the venv
    every named test would read as missing (``python scripts/reliability_table.py`` printed 94 false
    "missing test" lines, issue 53)."""
    missing = [m for m in ("pytest", "foursight") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"scripts/reliability_table.py runs in the project's venv: {sys.executable} cannot import {' and '.join(missing)}; "
              f"run .venv/bin/python scripts/reliability_table.py (bash scripts/setup.sh makes .venv)", file=sys.stderr)
        sys.exit(2)


def load_cases():
    spec = importlib.util.spec_from_file_location("reliability_cases", REPO / "tests" / "reliability_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES


def _pytest(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO, capture_output=True, text=True)


def collected(files: list[str]) -> set[str]:
    """Test ids (parameters stripped) that pytest collects from ``files``; exits (2, one line) when pytest
    itself fails, so that a broken collection is not reported as missing tests."""
    r = _pytest(["--collect-only", "-q", *files])
    if r.returncode not in (0, 5):  # 5: nothing collected
        tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
        print(f"pytest could not collect the tests ({sys.executable} -m pytest exited {r.returncode}): {tail[0]}", file=sys.stderr)
        sys.exit(2)
    return {line.split("[", 1)[0] for line in r.stdout.splitlines() if "::" in line}


def run(ids: list[str]) -> dict[str, str]:
    """Outcome per test id (``passed`` only when every parameter passed)."""
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "r.xml"
        _pytest(["-q", f"--junitxml={xml}", "--timeout=1800", *ids])
        res: dict[str, str] = {}
        for tc in ET.parse(xml).getroot().iter("testcase"):
            f = tc.get("classname", "").replace(".", "/") + ".py"
            tid = f"{f}::{tc.get('name', '').split('[', 1)[0]}"
            bad = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), None)
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(bad, "passed")
            if res.get(tid, "passed") == "passed":
                res[tid] = outcome
        return res


def table(cases, outcomes: dict[str, str] | None) -> str:
    rows = ["| issue | severity | case | status | test(s) | note |", "|---|---|---|---|---|---|"]
    for c in cases:
        tests = "<br>".join(f"`{t.split('::')[0].removeprefix('tests/')}::{t.split('::')[1]}`"
                            + (f" ({outcomes.get(t, 'not run')})" if outcomes is not None else "") for t in c.tests) or "none"
        rows.append(f"| {c.issue} | {c.severity} | {c.case} | **{c.status}** | {tests} | {c.note} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the named tests and add their outcome")
    ap.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(REPO)}")
    a = ap.parse_args()
    check_interpreter()
    cases = load_cases()
    ids = sorted({t for c in cases for t in c.tests})
    have = collected(sorted({t.split("::")[0] for t in ids}))
    missing = [t for t in ids if t not in have]
    for t in missing:
        print(f"missing test: {t}", file=sys.stderr)
    outcomes = run(ids) if a.run else None
    text = table(cases, outcomes)
    if a.write:
        doc = DOC.read_text()
        head, _, rest = doc.partition(BEGIN)
        _, _, tail = rest.partition(END)
        DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    print(text)
    bad = [t for t, o in (outcomes or {}).items() if o != "passed"]
    return 1 if missing or bad else 0


if __name__ == "__main__":
    sys.exit(main())
