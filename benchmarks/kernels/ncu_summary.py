#!/usr/bin/env python
"""Nsight Compute's raw CSV (``ncu --csv --page raw``) as one markdown table row per kernel launch.

``device_v4.sh``'s ``ncu`` step profiles ``probe_v4.py --ncu-target``: per M, one W4A4 call (the
quantizer ``_act_quant_kernel``, then ``_fragment_gemm_kernel``, or a Gluon form's ``_stream_kernel`` /
``_ws_kernel``) and one cuBLAS BF16 call (``nvjet_*``),
and writes every metric of every launch into one wide CSV (577 columns). Nobody reads that by eye; this
picks the columns issue 36 asks about: duration, DRAM read bandwidth, warps active and eligible per
scheduler, achieved occupancy, registers per thread, and the three largest stall reasons.

Launches are mapped to M through the ``[probe_v4 ncu] M=...`` lines the target prints (``--probe-log``,
one or more files; repeats of a line are read once): a new group starts at each launch of the first
launch's kernel, and the groups must be as many as those lines, in the same order.

No GPU: it reads a committed CSV and writes markdown.

    .venv/bin/python benchmarks/kernels/ncu_summary.py \
        benchmarks/results/h100-2026-12-06d-v4/probe_ncu_graph_call/ncu_stalls.csv \
        --probe-log benchmarks/results/h100-2026-12-06d-v4/probe_ncu_graph_call/rest/ncu.out \
        --out benchmarks/results/h100-2026-12-06d-v4/probe_ncu_graph_call/ncu_summary.md
"""

from __future__ import annotations

import argparse
import csv
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DURATION = "gpu__time_duration.sum"
DRAM_READ = "dram__bytes_read.sum.per_second"
WARPS_ACTIVE = "smsp__warps_active.avg.per_cycle_active"
WARPS_ELIGIBLE = "smsp__warps_eligible.avg.per_cycle_active"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"  # ncu's "Achieved Occupancy"
REGISTERS = "launch__registers_per_thread"
ISSUE = "smsp__issue_active.avg.pct_of_peak_sustained_active"  # cycles a scheduler issued, %
DRAM_PCT = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"  # DRAM throughput, % of peak
WARPS_PEAK = "smsp__warps_active.avg.peak_sustained"  # warps a scheduler can hold
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(?P<reason>.+)_per_issue_active\.ratio$")
#: "selected" counts the cycle a warp issues, not a stall (ncu's stall chart shows it for scale only)
NOT_A_STALL = {"selected"}
PROBE_LINE = re.compile(r"\[probe_v4 ncu\] M=(?P<M>\d+) (?P<shape>\S+) k=(?P<k>\d+) tile (?P<tile>\S+)")
#: microseconds per unit of ncu's time columns
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
#: ncu's decimal byte prefixes
BYTE_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
ROLES = {"_act_quant_kernel": "W4A4 quantizer", "_fragment_gemm_kernel": "W4A4 GEMM", "_stream_kernel": "W4A4 GEMM",
         "_ws_kernel": "W4A4 GEMM"}


@dataclass
class Launch:
    """One profiled kernel launch: the fields this summary shows, in fixed units."""

    index: int
    name: str
    grid: str
    block: str
    duration_us: float | None
    dram_read_tbps: float | None
    warps_active: float | None
    warps_eligible: float | None
    occupancy_pct: float | None
    registers: float | None
    issue_pct: float | None
    dram_pct: float | None
    warps_peak: float | None  # warps a scheduler can hold (``WARPS_PEAK``)
    stalls: list[tuple[str, float]] = field(default_factory=list)  # the three largest, largest first

    @property
    def role(self) -> str:
        return ROLES.get(self.name, "cuBLAS BF16" if self.name.startswith("nvjet") else "")


def number(text: str) -> float | None:
    """ncu's printed number (thousands separators allowed); None for an empty or ``n/a`` cell."""
    text = text.strip().replace(",", "")
    if text in ("", "n/a", "N/A"):
        return None
    return float(text)


def time_scale(unit: str) -> float:
    if unit not in TIME_UNITS:
        raise ValueError(f"{DURATION}: unknown time unit {unit!r} (known: {sorted(TIME_UNITS)})")
    return TIME_UNITS[unit]


def bandwidth_scale(unit: str) -> float:
    """Bytes per second per unit of ``unit`` (``byte/s``, ``Gbyte/second``, ...)."""
    m = re.fullmatch(r"(?P<p>[KMGT]?)byte/s(econd)?", unit)
    if not m:
        raise ValueError(f"{DRAM_READ}: unknown bandwidth unit {unit!r} (expected [K|M|G|T]byte/s or /second)")
    return BYTE_PREFIX[m["p"]]


def short_name(name: str) -> str:
    """The kernel name without its argument list or template arguments."""
    return re.split(r"[(<]", name, maxsplit=1)[0].strip().removeprefix("void ").strip()


def dims(text: str) -> str:
    """``(128, 4, 1)`` -> ``128×4×1``."""
    return "×".join(p.strip() for p in text.strip().strip("()").split(","))


def read_raw_csv(path: Path) -> tuple[list[str], dict[str, str], list[dict[str, str]]]:
    """Header, units (empty strings where ncu printed none, or all empty without a units row) and one
    dict per launch. Lines before the header (``#`` provenance, ``==PROF==``) are skipped."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"') or line.startswith("ID,")), None)
    if start is None:
        raise ValueError(f"{path}: no header row starting with ID: not ncu --csv --page raw output")
    rows = list(csv.reader(lines[start:]))
    header, body = rows[0], [r for r in rows[1:] if any(c.strip() for c in r)]
    units = {h: "" for h in header}
    if body and not body[0][0].strip():  # the units row: no launch ID
        units = dict(zip(header, body[0]))
        body = body[1:]
    for r in body:
        if len(r) != len(header):
            raise ValueError(f"{path}: launch row ID {r[0]!r} has {len(r)} cells, the header {len(header)}")
    return header, units, [dict(zip(header, r)) for r in body]


def launches(path: Path, top: int = 3) -> list[Launch]:
    header, units, rows = read_raw_csv(path)
    for need in ("Kernel Name", DURATION):
        if need not in header:
            raise ValueError(f"{path}: column {need!r} is missing")
    if not rows:
        raise ValueError(f"{path}: no kernel launch rows after the header (did ncu profile anything?)")
    t_scale = time_scale(units.get(DURATION) or "ns")  # ncu's raw page prints ns when it prints no unit
    bw_scale = bandwidth_scale(units.get(DRAM_READ) or "byte/s") if DRAM_READ in header else None
    stall_cols = [(STALL.match(h)["reason"], h) for h in header if STALL.match(h)]
    out = []
    for i, r in enumerate(rows):
        def get(col):
            return number(r[col]) if col in r else None

        dur, bw = get(DURATION), get(DRAM_READ)
        stalls = [(reason, v) for reason, col in stall_cols
                  if reason not in NOT_A_STALL and (v := number(r[col])) is not None]
        stalls.sort(key=lambda s: -s[1])
        out.append(Launch(
            index=i, name=short_name(r["Kernel Name"]),
            grid=dims(r.get("Grid Size", "")), block=dims(r.get("Block Size", "")),
            duration_us=None if dur is None else dur * t_scale,
            dram_read_tbps=None if bw is None or bw_scale is None else bw * bw_scale / 1e12,
            warps_active=get(WARPS_ACTIVE), warps_eligible=get(WARPS_ELIGIBLE),
            occupancy_pct=get(OCCUPANCY), registers=get(REGISTERS), issue_pct=get(ISSUE), dram_pct=get(DRAM_PCT),
            warps_peak=get(WARPS_PEAK), stalls=stalls[:top]))
    return out


def probe_lines(paths: list[Path]) -> list[dict]:
    """The ``[probe_v4 ncu]`` lines of the given logs, in order, each distinct line once."""
    seen, out = set(), []
    for p in paths:
        for m in PROBE_LINE.finditer(p.read_text()):
            key = m.group(0)
            if key not in seen:
                seen.add(key)
                out.append({"M": int(m["M"]), "shape": m["shape"], "k": int(m["k"]), "tile": m["tile"]})
    return out


def group(ls: list[Launch], probes: list[dict]) -> list[tuple[dict | None, list[Launch]]]:
    """Split the launches into one group per probe line: a group starts at each launch of the first
    launch's kernel. Without probe lines, the groups are returned unnamed."""
    groups: list[list[Launch]] = []
    for launch in ls:
        if not groups or launch.name == ls[0].name:
            groups.append([])
        groups[-1].append(launch)
    if not probes:
        return [(None, g) for g in groups]
    if len(groups) != len(probes):
        raise ValueError(f"{len(groups)} launch groups (each starting at {ls[0].name}) but {len(probes)} "
                         f"[probe_v4 ncu] lines (M = {[p['M'] for p in probes]}): cannot map launches to M")
    return list(zip(probes, groups))


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def markdown(csv_path: Path, grouped: list[tuple[dict | None, list[Launch]]], probe_paths: list[Path],
             base: Path | None = None) -> str:
    """The markdown page; file names are written relative to ``base`` (the output's folder) when given."""
    def rel(p: Path) -> str:
        return os.path.relpath(p, base) if base is not None else p.name

    prov = [ln[1:].strip() for ln in csv_path.read_text().splitlines() if ln.startswith("#")]
    peaks = sorted({la.warps_peak for _, g in grouped for la in g} - {None})
    peak = f", of {'/'.join(f'{p:g}' for p in peaks)} (`{WARPS_PEAK}`)" if peaks else ""
    lines = [f"# Nsight Compute, one row per kernel launch ({csv_path.name})", ""]
    if prov:
        lines += ["The CSV's own header: " + "; ".join(prov) + ".", ""]
    how = ("mapped to M by order: a group starts at each launch of the first launch's kernel, and the groups follow "
           f"the `[probe_v4 ncu]` lines of {', '.join(f'`{rel(p)}`' for p in probe_paths)} in order") if probe_paths else \
        "not mapped to M (no `--probe-log` given): groups are numbered"
    lines += [
        f"Made by `benchmarks/kernels/ncu_summary.py` from `{rel(csv_path)}` (`ncu --csv --page raw`). Launches are {how}.",
        f"Duration = `{DURATION}` (µs); DRAM read = `{DRAM_READ}` (TB/s, 10^12 bytes); warps active / eligible = "
        f"`{WARPS_ACTIVE}` / `{WARPS_ELIGIBLE}` (per scheduler{peak}); occupancy = `{OCCUPANCY}` (ncu's achieved "
        f"occupancy, %); regs = `{REGISTERS}`; issue % = `{ISSUE}`; DRAM % = `{DRAM_PCT}` (— where the CSV lacks "
        "a column). Stalls: the three largest "
        "`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio` (warps stalled per issued instruction), "
        "`selected` left out (it is the issuing cycle itself). ncu serialises each launch and, unless told otherwise "
        "(`--cache-control`, `--clock-control`), flushes the caches and locks the clocks to base before it: durations "
        "here are not the timer's figures.",
        "",
        "| M | role | kernel | grid | block | µs | DRAM read TB/s | DRAM % | warps active | warps eligible | issue % | occupancy % | regs "
        "| top stalls |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for gi, (probe, g) in enumerate(grouped):
        label = str(probe["M"]) if probe else f"group {gi}"
        for la in g:
            stalls = ", ".join(f"{r} {v:.2f}" for r, v in la.stalls) or "—"
            lines.append(f"| {label} | {la.role} | `{la.name}` | {la.grid} | {la.block} | {_f(la.duration_us, '.1f')} | "
                         f"{_f(la.dram_read_tbps, '.2f')} | {_f(la.dram_pct, '.1f')} | {_f(la.warps_active, '.2f')} | "
                         f"{_f(la.warps_eligible, '.2f')} | {_f(la.issue_pct, '.1f')} | {_f(la.occupancy_pct, '.1f')} | {_f(la.registers, '.0f')} | {stalls} |")
    if any(p for p, _ in grouped):
        lines += ["", "Tiles (from the probe lines): " + "; ".join(
            f"M = {p['M']}: {p['shape']} k = {p['k']} `{p['tile']}`" for p, _ in grouped if p)]
    lines += ["", "Per group: the W4A4 call (quantizer + GEMM, summed ncu durations) against the cuBLAS launch.", "",
              "| M | W4A4 quantizer µs | W4A4 GEMM µs | W4A4 sum µs | cuBLAS µs | cuBLAS / W4A4 sum |", "|---|---|---|---|---|---|"]
    for gi, (probe, g) in enumerate(grouped):
        by = {la.role: la.duration_us for la in g}
        q, gm, cb = by.get("W4A4 quantizer"), by.get("W4A4 GEMM"), by.get("cuBLAS BF16")
        s = None if q is None or gm is None else q + gm
        ratio = None if s is None or cb is None else cb / s
        lines.append(f"| {probe['M'] if probe else f'group {gi}'} | {_f(q, '.1f')} | {_f(gm, '.1f')} | {_f(s, '.1f')} | "
                     f"{_f(cb, '.1f')} | {_f(ratio, '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, help="ncu --csv --page raw output (lines before the ID header are skipped)")
    ap.add_argument("--probe-log", type=Path, action="append", default=[],
                    help="a log with probe_v4.py --ncu-target's [probe_v4 ncu] lines (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="markdown file to write")
    args = ap.parse_args(argv)
    grouped = group(launches(args.csv), probe_lines(args.probe_log))
    args.out.write_text(markdown(args.csv, grouped, args.probe_log, base=args.out.parent))
    print(f"wrote {args.out} ({sum(len(g) for _, g in grouped)} launches in {len(grouped)} groups)")


if __name__ == "__main__":
    main()
