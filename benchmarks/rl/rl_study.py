"""The RL study (v3: issue 35; v4: issue 51; docs/rl.md): rollout precisions x seeds, the same number of steps each,
spread over every visible GPU, in resumable chunks of one device call (run by ``benchmarks/rl/rl_device.sh run``).

    python benchmarks/rl/rl_study.py --model DIR --state /tmp/fsrl_state --out $OUT [--deadline-s 480]
        [--study v3|v4] [--arms bf16,nvfp4,...] [--seeds 0,1] [--steps 60]
    RL_STUDY=v4 RL_SEEDS=6,7 bash benchmarks/rl/rl_device.sh run   # the device script passes RL_STUDY through
    RL_DRY=1 python benchmarks/rl/rl_study.py --study v4 --seeds 6 --state /tmp/dry4 --out /tmp/dry4_out   # v4's CPU dry run

Studies (:data:`STUDIES`): ``v3`` (the default; six arms x seeds 0-5, any arm of :data:`ARMS` with ``--arms``) and
``v4`` (the pre-registered confirmatory design: ``nvfp4``, ``nvfp4_carve``, ``fs_filter`` x seeds 6-19 and ``bf16`` x
seeds 6-7; the evals add the learner's sampled accuracy and the engine's own greedy accuracy, and the filter's τ is
fitted online at step 1). A state folder holds one study (``manifest.json`` names it).
    python benchmarks/rl/rl_study.py --model DIR --state S --out O --timing [--arms ...]   # isolated step times
    RL_DRY=1 python benchmarks/rl/rl_study.py --state /tmp/dry --out /tmp/dry_out   # CPU dry run, tiny model

Every run is ``foursight rl`` (:func:`foursight.rl.run_rl`) in its own process with ``--resume``
and ``--stop-at`` = start + ``--deadline-s``: a run still going at the deadline writes a checkpoint
and a ``pause`` record, and the same command run again (machine still warm: the checkpoints live in
``--state``) continues it from that step; a completed log (ending in ``done``) is skipped. The
logs, ``manifest.json`` (per call: what was launched and skipped; per run: its command, GPU,
status, last step, exit code, seconds, BF16 weight share) and the runs' stdout are copied into
``--out`` every 15 s and at the end.

Arms (:data:`ARMS`; the main ones in :data:`MAIN_ARMS`, study v3, docs/rl.md): ``bf16``, ``nvfp4``
(k = 0), ``nvfp4_carve`` (NVFP4 with the practitioners' BF16 carve-out: the attention of the first two
and the last block, 2.50 % of the linear weights in BF16 on SmolLM2-135M, against FourSight 2 %'s
2.60 %), ``nvfp4_filter`` and ``fs_filter`` (the ``mean_abs`` filter at the τ fitted per engine,
benchmarks/results/rl/filter_tau.json), ``fs_comp`` (FourSight 2 %); opt-in: ``fp8`` (rowwise W8A8,
the FlashRL anchor), ``w4a16`` and the format-bonus pair. Shared settings: :data:`COMMON`. Seeds 0-5.
Launch order: :func:`launch_order`.

``--timing``: each arm alone on the GPU (one process at a time), :data:`TIMING` steps, no eval
after step 0; the logs' ``time/*`` per phase are the isolated step times (``rl_summary.py``
reads them from ``<arm>_t<seed>.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: arm -> (--rollout-precision, extra flags). The carve-out is the practitioners' attention +
#: first/last blocks pattern at FourSight 2 %'s BF16 weight share (docs/rl.md, "Study v2"). The
#: filter arms use the length-normalised ``mean_abs`` filter with τ fitted per engine before the
#: study (benchmarks/rl/rl_filter_tau.py -> FILTER_TAU_FILE; docs/rl.md, "Study v3").
CARVE = ["--bf16-layers", "attention&first:2", "--bf16-layers", "attention&last:1"]
#: the committed τ per engine; RL_FILTER_TAU_FILE points elsewhere (rl_device.sh: one fitted on the device)
FILTER_TAU_FILE = Path(os.environ.get("RL_FILTER_TAU_FILE") or Path(__file__).resolve().parents[1] / "results" / "rl" / "filter_tau.json")


def filter_flags(engine: str) -> list[str]:
    """``--filter mean_abs --filter-tau τ`` with the τ fitted for ``engine`` (nvfp4 | foursight)."""
    if not FILTER_TAU_FILE.exists():
        raise SystemExit(f"{FILTER_TAU_FILE} is missing: run benchmarks/rl/rl_filter_tau.py first (docs/rl.md)")
    tau = json.loads(FILTER_TAU_FILE.read_text())["engines"][engine]["tau"]
    return ["--filter", "mean_abs", "--filter-tau", f"{tau:.6g}"]


ARMS: dict[str, tuple[str, list[str] | str]] = {
    "bf16": ("bf16", []),
    "nvfp4": ("nvfp4", []),
    "nvfp4_carve": ("nvfp4", CARVE),
    "nvfp4_filter": ("nvfp4", "filter:nvfp4"),
    "fs_comp": ("foursight", []),
    "fs_filter": ("foursight", "filter:foursight"),
    # not in the main study (opt-in with --arms): the FlashRL anchor, FourSight W4A16, and the
    # format-bonus ablation (study v2's main setting, a reward attractor for quantized runs)
    "fp8": ("fp8", []),
    "w4a16": ("w4a16", []),
    "bf16_bonus": ("bf16", ["--format-bonus", "0.1"]),
    "nvfp4_bonus": ("nvfp4", ["--format-bonus", "0.1"]),
}
#: the arms of a plain call (the paper's 2 x 2 ablation + BF16 + the equal-byte carve-out), in launch order
MAIN_ARMS = ("bf16", "nvfp4", "nvfp4_carve", "nvfp4_filter", "fs_comp", "fs_filter")
SEEDS = (0, 1, 2, 3, 4, 5)
#: study v4 (issue 51, pre-registered in docs/rl.md "Study v4"): fresh seeds, never pooled with v3's; three arms on every
#: seed and BF16 on the first two as a ceiling anchor
V4_ARMS = ("nvfp4", "nvfp4_carve", "fs_filter")
V4_SEEDS = tuple(range(6, 20))
V4_ANCHOR_SEEDS = (6, 7)


def arm_flags(arm: str, study: str = "v3") -> tuple[str, list[str]]:
    """``--rollout-precision`` and the extra flags of ``arm`` in ``study``: a filter arm's τ comes from the committed
    file (v3) or is fitted online at step 1 by the same quantile rule (v4: ``--filter-tau-fit``)."""
    prec, extra = ARMS[arm]
    if not isinstance(extra, str):
        return prec, list(extra)
    q = STUDIES[study]["tau_fit"]
    return prec, (["--filter", "mean_abs", "--filter-tau-fit", f"{q:g}"] if q else filter_flags(extra.split(":", 1)[1]))


#: objective name -> flags added to every run: ``rollout`` = the engine's log-probs as π_old (the
#: 2026-12-03 study, every quantized run collapsed); ``learner-tis`` = what verl / TRL / FlashRL
#: users run (recomputed π_old; the engine's log-probs only in r, the filter and token TIS, cap 2)
OBJECTIVES: dict[str, list[str]] = {"rollout": [], "learner-tis": ["--old-logprobs", "learner", "--tis-cap", "2"]}
#: shared settings of every run (study v3, issue 35): no format bonus (no reward attractor), 30
#: steps with a 128-question greedy eval every 3, the learner in micro-batches of 32 sequences
COMMON = {"task": "seq1", "steps": 30, "prompts-per-step": 16, "group-size": 8, "max-new-tokens": 64, "lr": "2e-5",
          "eval-every": 3, "eval-size": 128, "channels": "2%", "format-bonus": "0", "micro-batch": 32}
#: flags without a value, added to every run: the follow/* diagnostics are off in the study (time)
COMMON_SWITCHES = ["--no-follow"]
#: the isolated timing runs: a few steps, the eval at step 0 only (on 16 questions)
TIMING = {"steps": 8, "eval-every": 1000, "eval-size": 16}
#: the CPU dry run: the tiny model, 2 steps
DRY = {"task": "seq1", "steps": 2, "prompts-per-step": 1, "group-size": 2, "max-new-tokens": 3, "lr": "2e-5",
       "eval-every": 1, "eval-size": 2, "channels": "16", "format-bonus": "0", "micro-batch": 1}
#: the carve-out on the tiny model of the dry run (2 blocks)
DRY_CARVE = ["--bf16-layers", "attention&first:1"]
#: GPU memory one run may take (GiB): the peak reserved by any run of study v3's first chunk (7.70 GiB,
#: `mem/peak_reserved_gib`, H100, benchmarks/results/rl/study-v3/) plus the CUDA context (not in torch's
#: reserved count) and a margin; --slots auto divides the GPU by it (8 on an H100, 15 on an H200)
RUN_GIB = 9.0


def auto_slots(run_gib: float = RUN_GIB, device: int = 0) -> int:
    """Concurrent runs that fit one GPU: (total memory - 2 GiB) / run_gib, at least 1
    (an H100's 79 GiB: 8; an H200's 139 GiB: 15)."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    return max(1, int((total - 2.0) // run_gib))


def run_names(arms=MAIN_ARMS, seeds=SEEDS, sep: str = "_s") -> list[str]:
    """Seed-major order: every arm of seed 0, then seed 1, ... (a chunk cut short has whole seeds)."""
    return [f"{c}{sep}{s}" for s in seeds for c in arms]


#: the named studies (``--study``, or RL_STUDY in the environment, so ``rl_device.sh`` passes it through unchanged):
#: ``runs`` the runs that make the study, ``common`` settings added to :data:`COMMON` (or :data:`DRY`), ``switches``
#: flags added to every run, ``tau_fit`` the quantile of the filter's online τ (None: τ from FILTER_TAU_FILE).
#: v4 = v3's regime (task, steps, batch, eval, learning rate, objective, HF engine) with the evals' two new metrics
#: (no effect on training, tests/test_rl_v4.py) and the filter's τ fitted online at step 1 (issue 51 item 3).
STUDIES: dict[str, dict] = {
    "v3": {"runs": run_names(MAIN_ARMS, SEEDS), "common": {}, "switches": [], "tau_fit": None},
    "v4": {"runs": [n for s in V4_SEEDS for n in (["bf16_s%d" % s] if s in V4_ANCHOR_SEEDS else []) + run_names(V4_ARMS, (s,))],
           "common": {"eval-sampled": 4}, "switches": ["--eval-engine"], "tau_fit": 0.9},
}


def study_names(study: str, arms: list[str] | None, seeds: tuple[int, ...] | None) -> list[str]:
    """The runs of ``study`` a call may start: all of them, or those of the given arms and seeds. v3 keeps its
    open form (any arm of :data:`ARMS` x any seed); another study refuses an arm or seed outside its design, so
    that no run of another design lands among its logs."""
    if study == "v3":
        return run_names(arms or MAIN_ARMS, seeds if seeds is not None else SEEDS)
    runs = STUDIES[study]["runs"]
    have_arms = {n.rsplit("_s", 1)[0] for n in runs}
    have_seeds = {int(n.rsplit("_s", 1)[1]) for n in runs}
    bad = sorted(set(arms or ()) - have_arms) + [f"seed {x}" for x in sorted(set(seeds or ()) - have_seeds)]
    if bad:
        raise SystemExit(f"study {study}: {bad} not in its design (arms {sorted(have_arms)}, seeds {sorted(have_seeds)})")
    return [n for n in runs if (not arms or n.rsplit("_s", 1)[0] in arms) and (seeds is None or int(n.rsplit("_s", 1)[1]) in seeds)]


#: relative cost of one step per rollout precision, for the launch order (chunk 2 of study v3, eight runs sharing
#: an H100: 9.3 s BF16, 13.5-15.2 s NVFP4, 15.0-15.3 s FourSight per step, benchmarks/results/rl/study-v3/summary.md;
#: the FourSight sync is the slowest phase)
STEP_COST = {"bf16": 1, "fp8": 2, "nvfp4": 2, "w4a16": 3, "foursight": 3}


def launch_order(names: list[str], statuses: dict[str, str]) -> list[str]:
    """The order a call starts its pending runs in: first the runs paused in an earlier call (their checkpoint
    lives only on this machine, so they must finish before it goes back), then seed by seed (a chunk cut short
    keeps whole seeds), within a seed the slowest arms first, so the call's tail is the fast arms and not a
    FourSight run left alone on the GPU (chunk 2: two FourSight runs ran 280 s alone after the others ended)."""
    def key(n: str):  # sorted() is stable: runs that tie keep the order of ``names``
        arm, seed = n.rsplit("_", 1)
        return (statuses.get(n) != "paused", int(seed[1:]), -STEP_COST[ARMS[arm][0]])
    return sorted(names, key=key)


def command(name: str, model: str, state: Path, stop_at: float, common: dict, device: str, dry: bool = False,
            study: str = "v3") -> list[str]:
    cfg, seed = name.rsplit("_", 1)
    prec, extra = arm_flags(cfg, study)
    if dry and extra == CARVE:
        extra = DRY_CARVE
    args = [sys.executable, "-c", "from foursight.cli import main; main()", "rl", "--model", model, "--seed", seed[1:],
            "--rollout-precision", prec, "--out", str(state / f"{name}.jsonl"), "--resume", "--stop-at", f"{stop_at:.0f}",
            "--device", device]
    for k, v in common.items():
        args += [f"--{k}", str(v)]
    return args + COMMON_SWITCHES + STUDIES[study]["switches"] + extra


def log_status(path: Path) -> dict:
    """``status`` (done / paused / running-or-killed / not started) and ``last_step`` of a run's log."""
    if not path.exists():
        return {"status": "not started", "last_step": 0}
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            break
    steps = [r["step"] for r in recs if r.get("type") == "step"]
    last = recs[-1].get("type") if recs else None
    status = {"done": "done", "pause": "paused"}.get(last, "incomplete")
    return {"status": status, "last_step": max(steps) if steps else 0}


def publish(state: Path, out: Path, manifest: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in state.glob("*.jsonl"):
        (out / f.name).write_bytes(f.read_bytes())
    for f in state.glob("*.log"):
        (out / f.name).write_bytes(f.read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (dry run: a tiny model is built)")
    ap.add_argument("--state", type=Path, required=True, help="persistent folder: logs and checkpoints")
    ap.add_argument("--out", type=Path, required=True, help="results folder (copies of the logs + manifest.json)")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="runs pause (checkpoint) at start + this")
    ap.add_argument("--slots", default="auto", help="concurrent runs per GPU: a number, or auto (the GPU's memory / "
                    f"--run-gib; {RUN_GIB:g} GiB a run); --timing: 1")
    ap.add_argument("--run-gib", type=float, default=RUN_GIB, help="GPU memory one run may take, for --slots auto")
    ap.add_argument("--latest-start-s", type=float, default=None,
                    help="no run starts later than this after the call starts (default: half of --deadline-s)")
    ap.add_argument("--study", default=os.environ.get("RL_STUDY", "v3"), choices=sorted(STUDIES),
                    help="the named design (docs/rl.md): its runs and settings; default $RL_STUDY or v3")
    ap.add_argument("--arms", default="", help=f"comma list of arms (of {sorted(ARMS)}; default: the study's)")
    ap.add_argument("--seeds", default="", help="comma list of seeds (default: the study's)")
    ap.add_argument("--only", default="", help="comma list of run names (<arm>_s<seed>), a subset of --arms x --seeds")
    ap.add_argument("--steps", type=int, default=None, help=f"steps of every run (default {COMMON['steps']})")
    ap.add_argument("--objective", choices=sorted(OBJECTIVES), default="learner-tis",
                    help="π_old and mismatch correction of every run (docs/rl.md): learner-tis (default) = the learner's π_old + "
                         "token TIS cap 2; rollout = the engine's log-probs as π_old, no TIS (the 2026-12-03 study)")
    ap.add_argument("--timing", action="store_true", help="isolated step times: each arm alone, a few steps (TIMING)")
    a = ap.parse_args()
    dry = os.environ.get("RL_DRY") == "1"
    t0 = time.time()
    stop_at = t0 + a.deadline_s
    # no run starts after latest_start (a short test deadline: runs start and pause at once)
    latest_start = t0 + (a.latest_start_s if a.latest_start_s is not None else (a.deadline_s / 2 if a.deadline_s > 120 else a.deadline_s))
    a.state.mkdir(parents=True, exist_ok=True)
    common = dict(DRY if dry else COMMON)
    common.update(STUDIES[a.study]["common"])
    if a.timing:
        common.update({k: v for k, v in TIMING.items() if not dry or k != "steps"})
    if a.steps is not None:
        common["steps"] = a.steps
    flags = OBJECTIVES[a.objective]
    common.update(dict(zip((f[2:] for f in flags[::2]), flags[1::2])))
    model = a.model
    if dry and model is None:
        from foursight.models import build_tiny_model

        tiny = a.state / "tiny"
        model = str(tiny if (tiny / "config.json").exists() else build_tiny_model(tiny))
    if model is None:
        raise SystemExit("--model is required (except with RL_DRY=1)")
    ngpu, gpu_name = 0, "cpu"
    if not dry:
        import torch

        ngpu = torch.cuda.device_count()
        gpu_name = torch.cuda.get_device_name(0) if ngpu else "cpu"
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        raise SystemExit(f"--arms: unknown {bad}; choose from {sorted(ARMS)}")
    seeds = tuple(int(x) for x in a.seeds.split(",") if x) or None
    if a.timing:
        names = run_names(arms or MAIN_ARMS, seeds if seeds is not None else SEEDS, "_t")
    else:
        names = study_names(a.study, arms, seeds)
    names = [n for n in names if not a.only or n in a.only.split(",")]
    arms = list(dict.fromkeys(n.rsplit("_", 1)[0] for n in names))
    if a.timing:
        slots = 1
    elif a.slots == "auto":
        slots = auto_slots(a.run_gib) if ngpu else len(names)
    else:
        slots = int(a.slots) or len(names)
    print(f"study: {len(names)} runs, {slots} at a time per GPU ({ngpu} GPUs)", flush=True)
    manifest = {"study": a.study, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "deadline_s": a.deadline_s, "gpus": ngpu,
                "gpu_name": gpu_name, "commit": os.environ.get("FOURSIGHT_COMMIT", ""), "slots": slots,
                "dry_run": dry, "timing": a.timing, "objective": a.objective, "common": common,
                "switches": COMMON_SWITCHES + STUDIES[a.study]["switches"],
                "arms": {k: {"rollout_precision": arm_flags(k, a.study)[0], "extra": arm_flags(k, a.study)[1]} for k in arms},
                "calls": [], "runs": {}}
    old = a.state / "manifest.json"
    if old.exists():  # keep the record of earlier calls
        prev = json.loads(old.read_text())
        if prev.get("study", "v3") != a.study:  # one state folder, one design: logs of two studies are never pooled
            raise SystemExit(f"--state {a.state} holds study {prev.get('study', 'v3')}'s runs; use another folder for {a.study}")
        manifest["calls"] = prev.get("calls", [])
        manifest["runs"] = prev.get("runs", {})
    call = {"started": manifest["started"], "arms": arms, "seeds": sorted({int(n.rsplit("_", 1)[1][1:]) for n in names}),
            "timing": a.timing, "launched": [], "skipped_done": []}
    manifest["calls"].append(call)
    pending = []
    statuses = {}
    for i, n in enumerate(names):
        st = log_status(a.state / f"{n}.jsonl")
        statuses[n] = st["status"]
        if st["status"] == "done":
            call["skipped_done"].append(n)
            manifest["runs"].setdefault(n, {}).update(st)
            continue
        pending.append((i, n))
    order = launch_order([n for _, n in pending], statuses)
    pending.sort(key=lambda item: order.index(item[1]))
    procs: dict[str, tuple[subprocess.Popen, float, int]] = {}
    per_gpu: dict[int, int] = {}
    last_pub = 0.0

    def refresh() -> None:
        for n in names:
            manifest["runs"].setdefault(n, {}).update(log_status(a.state / f"{n}.jsonl"))
        (a.state / "manifest.json").write_text(json.dumps(manifest, indent=2))
        publish(a.state, a.out, manifest)

    while pending or procs:
        # launch what fits
        for item in list(pending):
            i, n = item
            gpu = i % ngpu if ngpu else -1
            if per_gpu.get(gpu, 0) >= slots or (a.timing and procs):
                continue
            if time.time() > latest_start:
                break  # too late to start a run in this call (it could not finish in it): the next call starts it
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FOURSIGHT_KERNELS_AUTOTUNE="0")
            if gpu >= 0:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            cmd = command(n, model, a.state, stop_at, common, "cpu" if dry else "cuda", dry, a.study)
            fh = open(a.state / f"{n}.log", "a")
            procs[n] = (subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT), time.time(), gpu)
            per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
            manifest["runs"].setdefault(n, {}).update({"command": shlex.join(cmd[3:]), "gpu": gpu})
            call["launched"].append(n)
            pending.remove(item)
        if pending and not procs and time.time() > latest_start:
            break
        time.sleep(0.5 if dry else 2.0)
        for n, (p, ts, gpu) in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            per_gpu[gpu] -= 1
            del procs[n]
            r = manifest["runs"][n]
            r.update({"exit_code": rc, "seconds_this_call": round(time.time() - ts, 1)})
            head = _header(a.state / f"{n}.jsonl")
            r.update({k: head[k] for k in ("bf16_weight_share", "bf16_layer_share", "bf16_channel_share", "channels_k_fraction") if k in head})
            print(f"[{time.time() - t0:6.0f}s] {n}: exit {rc}, {log_status(a.state / f'{n}.jsonl')}", flush=True)
        if time.time() - last_pub > 15:
            refresh()
            last_pub = time.time()
    call["not_started"] = [n for _, n in pending]
    call["seconds"] = round(time.time() - t0, 1)
    refresh()
    done = sum(manifest["runs"][n].get("status") == "done" for n in names)
    print(f"study: {done}/{len(names)} runs done in {call['seconds']} s ({len(pending)} not started in this call); "
          f"results in {a.out}", flush=True)


def _header(path: Path) -> dict:
    try:
        return json.loads(path.read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return {}


if __name__ == "__main__":
    main()
