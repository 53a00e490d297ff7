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
