"""Prepare .devcarry/{a,b} for benchmarks/rl/rl_device.sh (two device calls of < 64 MiB each, the tree included).

    python benchmarks/rl/rl_prepare_carry.py

a/ (the stage call): wheels missing on the device (pydantic stack, gguf; Python 3.12 manylinux),
``code.tar`` (HEAD's source folders and benchmarks/rl, ``git archive``: the code the device runs, not
the working tree, which may hold uncommitted work) and the first half of the packaged SmolLM2 GGUF,
xz-compressed. b/ (the run calls): the second half, the GGUF's sha256, the CPU conversion's tokenizer
and config files, and the sha256 of the CPU conversion's tensors (compared on the device). Both: a
``commit`` file, HEAD, which every run's log records: run this after the last commit before the
device calls. ``.devcarry/`` is git-ignored (.gitignore). About 2 minutes (the xz pass).
"""

from __future__ import annotations

import hashlib
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

WHEELS = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "typing_extensions==4.16.0", "gguf==0.19.0"]


def main() -> None:
    from foursight.models import SMOLLM2_GGUF, prepare_smollm2, smollm2_gguf_dir
    from foursight.rl import state_dict_sha256

    root = Path(".devcarry")
    a, b = root / "a", root / "b"
    for d in (a, b / "hf"):
        d.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "--platform", "manylinux2014_x86_64", "-d", str(a), *WHEELS], check=True)
    gguf = (smollm2_gguf_dir() / SMOLLM2_GGUF).read_bytes()
    packed = lzma.compress(gguf, preset=6)  # 98 MB -> ~90 MB: the halves then leave room for the tree in each call
    half = len(packed) // 2
    for old in list(a.glob("gguf.*")) + list(b.glob("gguf.*")):
        old.unlink()
    (a / "gguf.xz.part00").write_bytes(packed[:half])
    (b / "gguf.xz.part01").write_bytes(packed[half:])
    (b / "gguf.sha256").write_text(hashlib.sha256(gguf).hexdigest() + "\n")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    tau = "benchmarks/results/rl/filter_tau.json"  # the committed filter τ, when there is one (else the device fits it)
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", tau], capture_output=True).returncode == 0
    arc = subprocess.run(["git", "archive", "--format=tar", "HEAD", "foursight_engine", "kernels", "quant_methods", "trainer_bridge",
                          "benchmarks/rl", "benchmarks/common.py", *([tau] if tracked else [])], capture_output=True, check=True).stdout
    (a / "code.tar").write_bytes(arc)
    shutil.rmtree(root / "code", ignore_errors=True)
    for d in (a, b):
        (d / "commit").write_text(head + "\n")
    model = prepare_smollm2()
    for f in list(model.glob("*.json")) + list(model.glob("*.jinja")):
        shutil.copy(f, b / "hf" / f.name)
    (b / "weights.sha256").write_text(state_dict_sha256(model) + "\n")
    print("ready:", a, b, {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in (a, b)})


if __name__ == "__main__":
    main()
