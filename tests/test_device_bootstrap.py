"""The device bootstrap on the CPU (benchmarks/device: fatbin.py, prepare.py, stage.py; docs/gpu.md).

* ``fatbin.keep_arch`` on a synthetic ELF: per fatbinary, the sm_90 SASS is kept, else the newest PTX <= 90,
  everything else zeroed; the file's size and every byte outside the zeroed payloads unchanged;
* ``prepare.pack`` cuts items into parts of at most the budget and ``stage.py`` joins them back, byte for byte;
* ``stage.py``'s checks: a part missing although a later one arrived means the machine went back (exit 3); a part
  still to come is named (exit 4); ``--receive-only`` waits; a distribution the image has at the same or a newer
  version is removed from the staged dependencies, an older one is kept.
* the device scripts stage through ``stage.sh`` (the kernel scripts by ``device_prelude.sh``; issue 56) and none
  lays the package out by hand any more.
"""

from __future__ import annotations

import importlib.util
import io
import lzma
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "benchmarks" / "device"


def _load(name: str):
    sys.path.insert(0, str(DEVICE))
    try:
        spec = importlib.util.spec_from_file_location(f"device_{name}", DEVICE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(DEVICE))


fatbin = _load("fatbin")


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    """One fatbinary: header, then (kind, arch, payload) entries with 64-byte entry headers."""
    body = b""
    for kind, arch, payload in entries:
        head = bytearray(64)
        struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, len(payload))
        struct.pack_into("<I", head, 28, arch)
        body += bytes(head) + payload
    return struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(section_data: bytes, pre: bytes = b"\x90" * 100) -> bytes:
    """A minimal ELF64 LE file: some bytes, a .nv_fatbin section, a string table, the section headers."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_off = 64 + len(pre)
    str_off = fat_off + len(section_data)
    sh_off = str_off + len(names)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", hdr, 0x28, sh_off)
    struct.pack_into("<HHH", hdr, 0x3A, 64, 3, 2)

    def sh(name: int, off: int, size: int) -> bytes:
        b = bytearray(64)
        struct.pack_into("<I", b, 0, name)
        struct.pack_into("<QQ", b, 0x18, off, size)
        return bytes(b)

    return bytes(hdr) + pre + section_data + names + sh(0, 0, 0) + sh(1, fat_off, len(section_data)) + sh(11, str_off, len(names))


def test_keep_arch_keeps_what_an_sm90_card_loads(tmp_path):
    a = [(2, 80, b"A80" * 50), (2, 90, b"A90" * 50), (1, 80, b"Aptx80" * 20)]  # SASS 90 there: keep it alone
    b = [(2, 80, b"B80" * 40), (1, 75, b"Bptx75" * 10), (1, 80, b"Bptx80" * 10), (2, 100, b"B100" * 10)]  # no SASS 90: newest PTX <= 90
    c = [(2, 100, b"C100" * 30), (2, 120, b"C120" * 30)]  # nothing an sm_90 card can run
    blob = _fatbin(a) + b"\0" * 8 + _fatbin(b) + _fatbin(c)
    src, dst = tmp_path / "lib.so", tmp_path / "trim.so"
    src.write_bytes(_elf(blob))
    stats = fatbin.keep_arch(src, dst, arch=90)
    before, after = src.read_bytes(), dst.read_bytes()
    assert len(before) == len(after) and stats["fatbins"] == 3
    ents = fatbin.entries(before)
    kept = {(e.kind, e.arch, before[e.payload:e.payload + 3]) for e in ents if after[e.payload:e.payload + e.size] != bytes(e.size)}
    assert kept == {(2, 90, b"A90"), (1, 80, b"Bpt")}, kept
    zeroed = [e for e in ents if after[e.payload:e.payload + e.size] == bytes(e.size)]
    assert len(zeroed) == len(ents) - 2 and stats["kept"] == 150 + 60
    mask = bytearray(len(before))  # every byte outside a zeroed payload is unchanged
    for e in zeroed:
        mask[e.payload:e.payload + e.size] = b"\1" * e.size
    assert all(x == y for x, y, m in zip(before, after, mask) if not m)


def test_keep_arch_refuses_a_file_without_fatbinaries(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"not an elf")
    with pytest.raises(ValueError, match="ELF"):
        fatbin.keep_arch(p, tmp_path / "y.so")


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return lzma.compress(buf.getvalue())


def _dist(name: str, version: str) -> dict[str, bytes]:
    """A distribution as pip --target leaves it: the package and its dist-info with a RECORD."""
    pkg = name.replace("-", "_")
    info = f"{pkg}-{version}.dist-info"
    files = {f"{pkg}/__init__.py": f"VERSION = {version!r}\n".encode(), f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]).encode()
    return files


@pytest.fixture()
def parts(tmp_path):
    """Three items (the 'base' dependency tree among them) packed by prepare.pack into parts of 40 kB."""
    prepare = _load("prepare")
    import random

    rnd = random.Random(0)
    items = {"vllm-ops.so.xz": bytes(rnd.getrandbits(8) for _ in range(70_000)),
             "base": _tar_xz({**_dist("fs-old-dep", "1.0"), **_dist("fs-new-dep", "3.0")}),
             "smollm2-hf.tar": bytes(rnd.getrandbits(8) for _ in range(50_000))}
    src = tmp_path / "items"
    src.mkdir()
    paths = {}
    for n, data in items.items():
        (src / n).write_bytes(data)
        paths[n] = src / n
    carry = tmp_path / "repo" / ".devcarry"
    dirs = prepare.pack(paths, carry, 40_000, "c0ffee")
    return {"items": items, "dirs": dirs, "carry": carry, "tmp": tmp_path}


def _stage(parts, monkeypatch, image_dir: Path | None = None):
    stage = _load("stage")
    monkeypatch.setattr(stage, "CARRY", parts["carry"])
    monkeypatch.setattr(stage, "STAGE", parts["tmp"] / "stage")
    if image_dir is not None:
        monkeypatch.syspath_prepend(str(image_dir))
    return stage


def test_pack_fills_parts_within_the_budget_and_stage_joins_them_back(parts, monkeypatch):
    assert len(parts["dirs"]) == 4  # 70 + ~1 + 50 kB in parts of 40 kB
    for d in parts["dirs"]:
        assert sum(f.stat().st_size for f in d.iterdir() if f.name != "MANIFEST.json") <= 40_000
    stage = _stage(parts, monkeypatch)
    manifest = stage.receive()
    assert manifest["parts"] == 4 and manifest["commit"] == "c0ffee"
    for name, data in parts["items"].items():
        assert stage.joined(manifest, name) == data, name


def test_a_missing_earlier_part_means_the_machine_went_back(parts, monkeypatch):
    import shutil

    for d in parts["dirs"][:2]:  # calls 1 and 2 ran on another machine: only p3 and p4 are here
        shutil.rmtree(d)
    stage = _stage(parts, monkeypatch)
    manifest = stage.receive()
    with pytest.raises(SystemExit) as e:
        stage.check(manifest, ["vllm-ops.so.xz"], receive_only=False)
    assert e.value.code == 3 and "went back" in str(e.value.args[0]) and "call 1" in str(e.value.args[0])


def test_a_later_part_is_named_and_receive_only_waits(parts, monkeypatch):
    import shutil

    shutil.rmtree(parts["dirs"][-1])  # p4 not carried yet
    stage = _stage(parts, monkeypatch)
    manifest = stage.receive()
    with pytest.raises(SystemExit) as e:
        stage.check(manifest, ["vllm-ops.so.xz", "smollm2-hf.tar"], receive_only=False)
    assert e.value.code == 4 and "p4" in str(e.value.args[0])
    assert stage.check(manifest, ["vllm-ops.so.xz", "smollm2-hf.tar"], receive_only=True) == ["vllm-ops.so.xz"]


def test_a_changed_chunk_is_refused(parts, monkeypatch):
    f = next(p for p in parts["dirs"][0].iterdir() if p.name != "MANIFEST.json")
    data = bytearray(f.read_bytes())
    data[5] ^= 1
    f.write_bytes(bytes(data))
    stage = _stage(parts, monkeypatch)
    with pytest.raises(SystemExit, match="sha256"):
        stage.receive()


def test_staged_dependencies_never_shadow_the_images(parts, monkeypatch, tmp_path):
    """The image has fs-old-dep 2.0 (newer than ours, 1.0: ours is removed) and fs-new-dep 2.5 (older than ours,
    3.0: ours is kept, since vLLM needs it)."""
    image = tmp_path / "image-site"
    for name, version in (("fs-old-dep", "2.0"), ("fs-new-dep", "2.5")):
        for rel, data in _dist(name, version).items():
            (image / rel).parent.mkdir(parents=True, exist_ok=True)
            (image / rel).write_bytes(data)
    stage = _stage(parts, monkeypatch, image_dir=image)
    manifest = stage.receive()
    stage.assemble(manifest, "base")
    deps = parts["tmp"] / "stage" / "deps"
    assert not (deps / "fs_old_dep").exists() and not list(deps.glob("fs_old_dep-*.dist-info"))
    assert (deps / "fs_new_dep" / "__init__.py").read_text() == "VERSION = '3.0'\n"


def test_pinned_wheels_leave_out_the_images_and_the_unused():
    """wheels-py312.txt pins each distribution once, none of what prepare.py leaves out, and what FourSight and a
    served vLLM import (checked on the H100, benchmarks/results/engine-h100-2026-12-07)."""
    prepare = _load("prepare")
    rows = [ln.split() for ln in prepare.PINS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    names = [prepare.norm(spec.split("==")[0]) for _, spec in rows]
    assert len(names) == len(set(names))
    assert all(g in ("base", "vllm") for g, _ in rows)
    assert not (set(names) - {"apache-tvm-ffi", "xgrammar"}) & prepare.LEAVE_OUT
    assert {"pydantic", "fastapi", "uvicorn", "openai", "compressed-tensors", "xgrammar", "gguf"} <= set(names)


def test_prepare_and_stage_scripts_answer_help():
    for script in ("prepare.py", "stage.py"):
        r = subprocess.run([sys.executable, str(DEVICE / script), "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr[-500:]
    r = subprocess.run(["bash", "-n", str(DEVICE / "stage.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


#: the kernel device scripts start with device_prelude.sh, which stages with profile base; the RL study stages model
KERNEL_SCRIPTS = ["benchmarks/kernels/device_v3.sh", "benchmarks/kernels/device_v4.sh", "benchmarks/kernels/device_ws.sh"]
STAGED = {"benchmarks/kernels/device_prelude.sh": "base", "benchmarks/rl/rl_device.sh": "model"}


@pytest.mark.parametrize("script", KERNEL_SCRIPTS + sorted(STAGED))
def test_device_scripts_stage_through_stage_sh(script):
    text = (REPO / script).read_text()
    if script in KERNEL_SCRIPTS:
        assert "source benchmarks/kernels/device_prelude.sh" in text, script
    else:
        assert "source benchmarks/device/stage.sh" in text and f"--need {STAGED[script]}" in text, script
    assert "foursight_engine" not in text and ".devcarry/a" not in text and "--target /tmp/site" not in text, script
    r = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_no_benchmark_copies_the_package_folders():
    """The hand-made layouts (``cp -r foursight_engine``, ``copytree(... "foursight_engine" ...)``) are gone from benchmarks/;
    gpu_requant.py names the staging step when FourSight is not importable."""
    for f in sorted((REPO / "benchmarks").rglob("*")):
        if f.suffix in (".sh", ".py") and "results" not in f.parts:
            text = f.read_text()
            assert "cp -r foursight_engine" not in text and '"foursight_engine")' not in text, f
    r = subprocess.run([sys.executable, "-I", "-S", str(REPO / "benchmarks/weight_sync/gpu_requant.py"), "--out", "/nonexistent"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "benchmarks/device/stage.sh --need base" in r.stderr, r.stderr[-500:]

