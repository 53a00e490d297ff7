"""Prepare, on the CPU, the parts a bare GPU machine needs: ``.devcarry/p1`` ... ``pN``, one per device call.

    .venv/bin/python benchmarks/device/prepare.py                   # vLLM 0.26.0 + SmolLM2 (every profile's items)
    .venv/bin/python benchmarks/device/prepare.py --profile vllm    # vLLM 0.26.0 alone (the engine benchmark)
    .venv/bin/python benchmarks/device/prepare.py --profile base    # FourSight's own dependencies (the kernel scripts)

The device machine has torch 2.11.0 and Triton 3.6 on Python 3.12 and reaches no package index; a call carries
at most 64 MiB, the working tree included. vLLM 0.26.0 is the last release pinned to torch 2.11.0, but its wheel
is 304 MB. What a dense Llama on sm_90 loads from it is far less (docs/gpu.md, "The device bootstrap"):

* ``vllm-ops.so.xz``: ``vllm/_C_stable_libtorch.abi3.so`` (79 MB; ``vllm/platforms/cuda.py`` imports it) with
  every fatbinary image but sm_90's zeroed (:mod:`fatbin`): 14.8 MB as xz instead of 55.9 MB;
* ``vllm-fa3.so.xz``: FlashAttention 3 (``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``, 153 MB, sm_90 only);
* ``vllm-py.tar.xz``: the rest of the wheel without FA2 (305 MB; its import is guarded), the MoE ops (a dense
  model never loads them; guarded), ``vllm-rs`` (only with ``VLLM_RUST_FRONTEND_PATH``), deep_gemm and fmha_sm100;
* ``base.tar.xz`` and ``vllm-deps.tar.xz``: the wheels of ``wheels-py312.txt`` (FourSight's own needs, then
  vLLM's closure minus what the image has), installed into a folder and compressed as one tree;
* ``smollm2.gguf.xz`` and ``smollm2-hf.tar``: the packaged SmolLM2-135M-Instruct GGUF and the CPU conversion's
  tokenizer/config files with the sha256 of its tensors (the device converts it and compares).

The items are cut into chunks and packed, in that order, into parts that each leave room for the working tree
(``git ls-files -co --exclude-standard``, measured now). Every part holds ``MANIFEST.json`` (every item's
chunks with their sha256, the commit, the part's number). ``.devcarry/`` is git-ignored; the built items are
cached under ``~/.cache/foursight/device`` (the xz pass takes about 3 minutes on 2 cores, once).
The printed call sequence runs ``benchmarks/device/stage.sh`` (:mod:`stage`) on the device.
``--resolve`` re-resolves ``wheels-py312.txt`` with pip's resolver (no download of what is left out).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import fatbin  # noqa: E402
from stage import PROFILES  # noqa: E402 - the item profiles, written once (stage.py runs on the device)

VLLM = "vllm==0.26.0"
PINS = HERE / "wheels-py312.txt"
CALL_MIB = 64  # what one device call carries, the tree included
MARGIN_MIB = 1.5  # headroom for files that appear between prepare and the call (logs, caches)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [a for p in PLATFORMS for a in ("--platform", p)]
# members of the vLLM wheel a dense Llama on sm_90 never loads (docs/gpu.md says why for each)
WHEEL_DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs",
              "vllm/third_party/deep_gemm", "vllm/third_party/fmha_sm100")
OPS, FA3 = "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
# left out of the closure: the image's own (torch and its CUDA wheels, HF stack, numpy, ...) and what a dense
# model on sm_90 never imports (vLLM's guarded imports of other kernels, media decoders, numba)
LEAVE_OUT = set("""torch torchaudio torchvision torchcodec pynvvideocodec flashinfer-python apache-tvm-ffi tilelang
nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels nvidia-cudnn-frontend nvtx fastsafetensors numba
opencv-python-headless xgrammar triton sympy mpmath networkx jinja2 markupsafe fsspec filelock numpy transformers
tokenizers safetensors huggingface-hub hf-xet pillow regex requests urllib3 idna certifi charset-normalizer pyyaml tqdm
packaging sentencepiece tiktoken cuda-bindings cuda-pathfinder kernels""".split())
BASE = set("""pydantic pydantic-core annotated-types typing-inspection typing-extensions typer rich click shellingham
markdown-it-py mdurl pygments gguf setuptools""".split())
EXTRA = ["compressed-tensors==0.17.0", "loguru", "typer>=0.12", "rich>=13", "gguf==0.19.0", "uvicorn", "httpx"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True)


def xz(data_or_path, dst: Path) -> Path:
    """xz -9 of a file or bytes, written atomically."""
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    src = data_or_path.read_bytes() if isinstance(data_or_path, Path) else data_or_path
    tmp.write_bytes(lzma.compress(src, preset=9 | lzma.PRESET_EXTREME if len(src) < (1 << 24) else 9))
    tmp.replace(dst)
    return dst


def pins(group: str) -> list[str]:
    rows = [ln.split() for ln in PINS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return [spec for g, spec in rows if g == group]


def vllm_wheel(cache: Path) -> Path:
    found = sorted((cache / "wheels").glob("vllm-0.26.0-*.whl"))
    if not found:
        pip("download", "--no-deps", *TARGET, "-d", str(cache / "wheels"), VLLM)
        found = sorted((cache / "wheels").glob("vllm-0.26.0-*.whl"))
    return found[0]


def build_tree_item(cache: Path, group: str, dst: Path) -> Path:
    """The pinned wheels of ``group`` installed into one folder (pip --target, cp312), as a tar.xz."""
    wheels = cache / "wheels" / group
    wheels.mkdir(parents=True, exist_ok=True)
    pip("download", "--no-deps", *TARGET, "-d", str(wheels), *pins(group))
    with tempfile.TemporaryDirectory() as td:
        target = Path(td) / "t"
        want = {norm(s.split("==")[0]): s.split("==")[1] for s in pins(group)}
        files = [w for w in wheels.glob("*.whl") if want.get(norm(w.name.split("-")[0])) == w.name.split("-")[1]]
        missing = set(want) - {norm(w.name.split("-")[0]) for w in files}
        if missing:
            raise SystemExit(f"prepare: no wheel downloaded for {sorted(missing)} (group {group})")
        pip("install", "--no-deps", "--no-index", "--no-compile", "--target", str(target), *TARGET, *map(str, files))
        shutil.rmtree(target / "bin", ignore_errors=True)  # console scripts with this machine's interpreter path
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p in sorted(target.rglob("*")):
                if "__pycache__" not in p.parts:
                    tar.add(p, arcname=str(p.relative_to(target)), recursive=False)
        return xz(buf.getvalue(), dst)


def build_items(cache: Path, names: list[str]) -> dict[str, Path]:
    key = hashlib.sha256(PINS.read_bytes() + (HERE / "fatbin.py").read_bytes() + VLLM.encode()).hexdigest()[:12]
    items = cache / f"items-{key}"
    items.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name in names:
        if name in ("base", "vllm-deps"):
            dst = items / f"{name}.tar.xz"
            if not dst.exists():
                print(f"prepare: {name}: installing {len(pins(name.split('-')[0]))} wheels and compressing", flush=True)
                build_tree_item(cache, name.split("-")[0], dst)
        elif name.startswith("vllm-"):
            dst = items / name
            if not dst.exists():
                whl = vllm_wheel(cache)
                print(f"prepare: {name} from {whl.name}", flush=True)
                with zipfile.ZipFile(whl) as z, tempfile.TemporaryDirectory() as td:
                    if name == "vllm-ops.so.xz":
                        z.extract(OPS, td)
                        stats = fatbin.keep_arch(Path(td) / OPS, Path(td) / "ops.so", arch=90)
                        print(f"prepare: core ops: kept {stats['kept'] / 1e6:.1f} MB of sm_90 images, zeroed {stats['zeroed'] / 1e6:.1f} MB"
                              f" ({stats['fatbins']} fatbinaries)", flush=True)
                        xz(Path(td) / "ops.so", dst)
                    elif name == "vllm-fa3.so.xz":
                        xz(z.read(FA3), dst)
                    else:
                        buf = io.BytesIO()
                        with tarfile.open(fileobj=buf, mode="w") as tar:
                            for info in z.infolist():
                                n = info.filename
                                if n in (OPS, FA3) or any(n == d or n.startswith(d + "/") for d in WHEEL_DROP) or info.is_dir():
                                    continue
                                ti = tarfile.TarInfo(n)
                                ti.size = info.file_size
                                ti.mode = 0o755 if n.endswith(".so") else 0o644
                                tar.addfile(ti, io.BytesIO(z.read(n)))
                        xz(buf.getvalue(), dst)
        elif name == "smollm2.gguf.xz":
            dst = items / name
            if not dst.exists():
                from foursight.models import SMOLLM2_GGUF, smollm2_gguf_dir

                print("prepare: SmolLM2 GGUF", flush=True)
                xz(smollm2_gguf_dir() / SMOLLM2_GGUF, dst)
        elif name == "smollm2-hf.tar":
            dst = items / name  # small, rebuilt each time (the conversion's files may change with the code)
            from foursight.models import prepare_smollm2
            from foursight.rl import state_dict_sha256

            model = prepare_smollm2()
            with tarfile.open(dst, "w") as tar:
                for f in sorted(list(model.glob("*.json")) + list(model.glob("*.jinja"))):
                    tar.add(f, arcname=f"hf/{f.name}")
                data = (state_dict_sha256(model) + "\n").encode()
                ti = tarfile.TarInfo("weights.sha256")
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
        else:
            raise SystemExit(f"prepare: unknown item {name!r}")
        out[name] = dst
    return out


def tree_bytes() -> int:
    """What the device tool sends besides the carried paths: tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in files.decode().split("\0") if f and (ROOT / f).is_file())


def pack(items: dict[str, Path], out: Path, budget: int, commit: str) -> list[Path]:
    """Cut the items into chunks filling parts of ``budget`` bytes, in order; write every part's MANIFEST.json."""
    for old in out.glob("p*"):
        shutil.rmtree(old)
    parts: list[dict[str, bytes]] = [{}]
    room = budget
    manifest_items: dict[str, dict] = {}
    for name, path in items.items():
        data = path.read_bytes()
        chunks, pos, i = [], 0, 0
        while pos < len(data):
            if room < min(64 * 1024, budget // 8):  # not worth a chunk: next part
                parts.append({})
                room = budget
            take = min(room, len(data) - pos)
            cname = f"{name}.{i:02d}"
            parts[-1][cname] = data[pos:pos + take]
            chunks.append({"name": cname, "part": len(parts), "sha256": hashlib.sha256(data[pos:pos + take]).hexdigest()})
            pos, room, i = pos + take, room - take, i + 1
        manifest_items[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "chunks": chunks}
    dirs = []
    for n, files in enumerate(parts, 1):
        d = out / f"p{n}"
        d.mkdir(parents=True)
        for cname, blob in files.items():
            (d / cname).write_bytes(blob)
        (d / "MANIFEST.json").write_text(json.dumps({"part": n, "parts": len(parts), "commit": commit, "items": manifest_items}, indent=1))
        dirs.append(d)
    return dirs


def resolve(cache: Path) -> None:
    """Rewrite wheels-py312.txt from vLLM 0.26.0's Requires-Dist with pip's resolver (the module docstring)."""
    whl = vllm_wheel(cache)
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    keep = [r for r in reqs if norm(re.split(r"[=<>!\[ ;~]", r, maxsplit=1)[0]) not in LEAVE_OUT]
    with tempfile.TemporaryDirectory() as td:
        req = Path(td) / "req.txt"
        req.write_text("\n".join(keep + EXTRA) + "\n")
        pip("install", "--dry-run", "--ignore-installed", "--target", str(Path(td) / "t"), *TARGET, "--report", str(Path(td) / "r.json"),
            "-r", str(req))
        report = json.loads((Path(td) / "r.json").read_text())
    rows = []
    for inst in report["install"]:
        n, v = norm(inst["metadata"]["name"]), inst["metadata"]["version"]
        if n in LEAVE_OUT or n.startswith("nvidia-"):
            continue
        rows.append(("base" if n in BASE else "vllm", n, v))
    rows += [("vllm", "xgrammar", "0.2.9"), ("vllm", "apache-tvm-ffi", "0.1.11")]
    head = [ln for ln in PINS.read_text().splitlines() if ln.startswith("#")]
    PINS.write_text("\n".join(head + [f"{g} {n}=={v}" for g, n, v in sorted(rows)]) + "\n")
    print(f"prepare: wrote {PINS.relative_to(ROOT)} ({len(rows)} wheels)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="all", help="which items (default: all)")
    ap.add_argument("--out", default=str(ROOT / ".devcarry"), help="where the parts go (git-ignored; default .devcarry)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "foursight" / "device"))
    ap.add_argument("--resolve", action="store_true", help="re-resolve wheels-py312.txt, then stop")
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    if args.resolve:
        return resolve(cache)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    items = build_items(cache, PROFILES[args.profile])
    tree = tree_bytes()
    budget = int((CALL_MIB - MARGIN_MIB) * 2**20) - tree
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    dirs = pack(items, out, budget, commit)
    print(f"prepare: tree {tree / 2**20:.1f} MiB; items " + ", ".join(f"{k} {v.stat().st_size / 1e6:.1f} MB" for k, v in items.items()))
    print(f"prepare: {len(dirs)} parts of at most {budget / 2**20:.1f} MiB each in {out} (commit {commit[:12]}). Call sequence, each call"
          " within the 30 s the machine stays warm after the last (docs/gpu.md):")
    for i, d in enumerate(dirs, 1):
        rel = d.relative_to(ROOT) if d.is_relative_to(ROOT) else d
        flags = f"--need {args.profile}" + ("" if i == len(dirs) else " --receive-only")
        print(f'  call {i}: run(command="source benchmarks/device/stage.sh {flags} && <your command>", carry=["{rel}"])')
    print("prepare: a device script that stages itself (benchmarks/kernels/device_*.sh, benchmarks/rl/rl_device.sh: its header"
          " says which calls) runs in place of the source step")


if __name__ == "__main__":
    main()
