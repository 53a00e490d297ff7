"""Offline SASS of a Triton kernel, shared by sass_offline.py (sm_90a) and sass_blackwell.py (sm_100a,
sm_120a): compile with launch-like specialization for a GPU that is not here, disassemble, and find
the loops.

Triton ships ``ptxas`` and ``cuobjdump``, so ``triton.compile`` with ``GPUTarget("cuda", cap, 32)``
works on a CPU-only machine. A loop is a backward branch: every instruction from the branch target
to the branch. The branch may be plain (``BRA 0x..``), predicated (``@P0 BRA 0x..``) or a uniform
conditional branch (``BRA.U !UP3, 0x..``; the sm_100 main loops end with one).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from typing import Iterable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BACKWARD_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)")  # BRA 0x.., BRA.U !UP3, 0x..


def compile_kernel(fn, cap: int, signature: dict, constexprs: dict, divisible_by_16: Iterable[str], **options):
    """``triton.compile`` of the ``@triton.jit`` function ``fn`` for ``sm_<cap>``: ``signature`` gives every
    parameter's type (``"constexpr"`` for those in ``constexprs``), ``divisible_by_16`` the parameters that
    Triton marks divisible by 16 at launch; ``options`` are the compile options (num_warps, num_stages, ...)."""
    params = list(inspect.signature(fn.fn).parameters)
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in divisible_by_16}
    src = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)


def sass_of(compiled) -> str:
    """The SASS of a compiled kernel (Triton's ``cuobjdump --dump-sass`` of its cubin)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction, in order."""
    return [(int(m.group(1), 16), m.group(2)) for m in _INSTRUCTION.finditer(sass)]


def opcode(text: str) -> str:
    """The full opcode (with modifiers, e.g. ``UTCOMMA.4X``) of one instruction, its predicate removed."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loops(sass: str) -> list[list[str]]:
    """The full opcodes of every loop body (see the module docstring), one list per backward branch."""
    ins = instructions(sass)
    out = []
    for addr, text in ins:
        m = _BACKWARD_BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            out.append([opcode(t) for a, t in ins if int(m.group(1), 16) <= a <= addr])
    return out
