"""The RL study of issue 16: 7 rollout configurations x 3 seeds, the same number of steps each,
spread over every visible GPU, resumable (run by ``benchmarks/rl_device.sh run``).

    python benchmarks/rl_study.py --model DIR --state /tmp/fsrl_state --out $OUT [--deadline-s 540]
    RL_DRY=1 python benchmarks/rl_study.py --state /tmp/dry --out /tmp/dry_out   # CPU dry run, tiny model

Every run is ``foursight rl`` (:func:`foursight.rl.run_rl`) in its own process with ``--resume``
and ``--stop-at`` = start + ``--deadline-s``: a run still going at the deadline writes a checkpoint
and a ``pause`` record, and the same command run again continues it from that step (a completed
log, ending in ``done``, is skipped). Logs and checkpoints live in ``--state`` (kept between
device calls while the machine stays warm); the logs, ``manifest.json`` (what ran: per run its
command, GPU, status, last step, exit code, seconds) and ``study.log`` are copied into ``--out``
every 15 s and at the end.

GPUs: runs are assigned round-robin over ``torch.cuda.device_count()`` GPUs through
``CUDA_VISIBLE_DEVICES`` and all started at once (``--slots`` per GPU caps it; default: all).

The settings (steps, batch, filter τ, error target) and the time arithmetic are in
``benchmarks/rl_device.sh``'s header; they are the defaults below.
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

#: run name -> (--rollout-precision, extra flags). The filter τ and the error target come from
#: CPU measurements on the real model (docs/rl.md, "Choosing the filter and the error budget").
FILTER_TAU = 2.5
ERROR_TARGET = 0.12
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "bf16": ("bf16", []),
    "fp8": ("fp8", []),
    "nvfp4": ("nvfp4", []),
    "fs_comp": ("foursight", []),
    "fs_filter": ("foursight", ["--filter", "max_token", "--filter-tau", str(FILTER_TAU)]),
    "fs_budget": ("foursight", ["--error-target", str(ERROR_TARGET), "--max-k", "256"]),
    "w4a16": ("w4a16", []),
}
SEEDS = (0, 1, 2)
#: objective name -> flags added to every run: the first study used the engine's log-probs as π_old
#: with no correction (every quantized run collapsed, docs/rl.md); learner-tis is what verl / TRL /
#: FlashRL users run (recomputed π_old, the engine's log-probs only in r, the filter and token TIS)
OBJECTIVES: dict[str, list[str]] = {"rollout": [], "learner-tis": ["--old-logprobs", "learner", "--tis-cap", "2"]}
#: shared settings of every run (the equal-step study)
COMMON = {"task": "add", "steps": 30, "prompts-per-step": 8, "group-size": 8, "max-new-tokens": 8, "lr": "2e-5",
          "eval-every": 5, "eval-size": 64, "channels": "2%"}
#: the CPU dry run: the tiny model, 3 steps
DRY = {"task": "add", "steps": 2, "prompts-per-step": 1, "group-size": 2, "max-new-tokens": 2, "lr": "2e-5",
       "eval-every": 1, "eval-size": 2, "channels": "16"}


def run_names(configs=CONFIGS, seeds=SEEDS) -> list[str]:
    """Seed-major order: every configuration of seed 0, then seed 1, ..."""
    return [f"{c}_s{s}" for s in seeds for c in configs]


def command(name: str, model: str, state: Path, stop_at: float, common: dict, device: str) -> list[str]:
    cfg, seed = name.rsplit("_s", 1)
    prec, extra = CONFIGS[cfg]
    args = [sys.executable, "-c", "from foursight.cli import main; main()", "rl", "--model", model, "--seed", seed,
            "--rollout-precision", prec, "--out", str(state / f"{name}.jsonl"), "--resume", "--stop-at", f"{stop_at:.0f}",
            "--device", device]
    for k, v in common.items():
        args += [f"--{k}", str(v)]
    return args + extra


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
    ap.add_argument("--deadline-s", type=float, default=540.0, help="runs pause (checkpoint) at start + this")
    ap.add_argument("--slots", type=int, default=0, help="concurrent runs per GPU (0: all at once)")
    ap.add_argument("--only", default="", help="comma list of run names (default: all 21)")
    ap.add_argument("--seeds", default="", help="comma list of seeds (default 0,1,2)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"steps of every run (default {COMMON['steps']}; a longer follow-up of some runs, e.g. BF16's plateau)")
    ap.add_argument("--objective", choices=sorted(OBJECTIVES), default="rollout",
                    help="π_old and mismatch correction of every run (docs/rl.md): rollout = the engine's log-probs as "
                         "π_old, no TIS (the 2026-12-03 study); learner-tis = the learner's π_old + token TIS cap 2")
    a = ap.parse_args()
    dry = os.environ.get("RL_DRY") == "1"
    t0 = time.time()
    stop_at = t0 + a.deadline_s
    a.state.mkdir(parents=True, exist_ok=True)
    common = dict(DRY if dry else COMMON)
    if a.steps is not None:
        common["steps"] = a.steps
    if a.objective != "rollout":
        flags = OBJECTIVES[a.objective]
        common.update(dict(zip((f[2:] for f in flags[::2]), flags[1::2])))
    model = a.model
    if dry and model is None:
        from foursight.models import build_tiny_model

        model = str(build_tiny_model(a.state / "tiny"))
    if model is None:
        raise SystemExit("--model is required (except with RL_DRY=1)")
    ngpu = 0
    if not dry:
        import torch

        ngpu = torch.cuda.device_count()
    seeds = tuple(int(x) for x in a.seeds.split(",")) if a.seeds else SEEDS
    names = [n for n in run_names(seeds=seeds) if not a.only or n in a.only.split(",")]
    slots = a.slots or len(names)
    manifest = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "deadline_s": a.deadline_s, "gpus": ngpu,
                "dry_run": dry, "objective": a.objective, "common": common, "configs": {k: {"rollout_precision": p, "extra": e} for k, (p, e) in CONFIGS.items()},
                "calls": [], "runs": {}}
    old = a.state / "manifest.json"
    if old.exists():  # keep the record of earlier calls
        prev = json.loads(old.read_text())
        manifest["calls"] = prev.get("calls", [])
        manifest["runs"] = prev.get("runs", {})
    call = {"started": manifest["started"], "launched": [], "skipped_done": []}
    manifest["calls"].append(call)
    pending = []
    for i, n in enumerate(names):
        st = log_status(a.state / f"{n}.jsonl")
        if st["status"] == "done":
            call["skipped_done"].append(n)
            manifest["runs"].setdefault(n, {}).update(st)
            continue
        pending.append((i, n))
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
            if per_gpu.get(gpu, 0) >= slots:
                continue
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            if gpu >= 0:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            cmd = command(n, model, a.state, stop_at, common, "cpu" if dry else "cuda")
            fh = open(a.state / f"{n}.log", "a")
            procs[n] = (subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT), time.time(), gpu)
            per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
            manifest["runs"].setdefault(n, {}).update({"command": shlex.join(cmd[3:]), "gpu": gpu})
            call["launched"].append(n)
            pending.remove(item)
        time.sleep(0.5 if dry else 2.0)
        for n, (p, ts, gpu) in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            per_gpu[gpu] -= 1
            del procs[n]
            r = manifest["runs"][n]
            r.update({"exit_code": rc, "seconds_this_call": round(time.time() - ts, 1)})
            print(f"[{time.time() - t0:6.0f}s] {n}: exit {rc}, {log_status(a.state / f'{n}.jsonl')}", flush=True)
        if time.time() - last_pub > 15:
            refresh()
            last_pub = time.time()
    call["seconds"] = round(time.time() - t0, 1)
    refresh()
    done = sum(manifest["runs"][n].get("status") == "done" for n in names)
    print(f"study: {done}/{len(names)} runs done in {call['seconds']} s; results in {a.out}", flush=True)


if __name__ == "__main__":
    main()
