"""Offline SASS of a Triton or Gluon kernel, shared by sass_offline.py (sm_90a) and sass_blackwell.py
(sm_100a, sm_120a): compile with launch-like specialization for a GPU that is not here, disassemble,
find the loops, and read the resource usage (registers, local memory, shared memory).

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


def is_gluon(fn) -> bool:
    """``fn`` is a ``@gluon.jit`` kernel (Triton's ``GluonJITFunction``; ``@triton.jit`` ones say False)."""
    return bool(getattr(fn, "is_gluon", lambda: False)())


def compile_kernel(fn, cap: int, signature: dict, constexprs: dict, divisible_by_16: Iterable[str], **options):
    """``triton.compile`` of the ``@triton.jit`` or ``@gluon.jit`` function ``fn`` for ``sm_<cap>``:
    ``signature`` gives every parameter's type (``"constexpr"`` for those in ``constexprs``),
    ``divisible_by_16`` the parameters that Triton marks divisible by 16 at launch; ``options`` are the
    compile options (num_warps, num_stages, maxnreg, ...). A Gluon kernel is built from Triton's
    ``GluonASTSource`` (its front end lowers straight to TritonGPU IR); its constexprs may be layout
    objects (``gl.NVMMASharedLayout`` ...), passed as they are, as a launch passes them."""
    params = list(inspect.signature(fn.fn).parameters)
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in divisible_by_16}
    source = ASTSource
    if is_gluon(fn):
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)


def _cuobjdump(compiled, flag: str) -> str:
    """Triton's ``cuobjdump <flag>`` of the compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def sass_of(compiled) -> str:
    """The SASS of a compiled kernel (``cuobjdump --dump-sass`` of its cubin)."""
    return _cuobjdump(compiled, "--dump-sass")


def resources(compiled, sass: str | None = None) -> dict:
    """Per-thread ``registers``, ``local_bytes`` (local memory: register spills and local arrays) and
    ``stack_bytes`` of the kernel (``cuobjdump --dump-resource-usage``), ``spill_instructions`` (the
    ``STL``/``LDL`` of its SASS) and ``shared_bytes``, the shared memory the launch asks for (Triton's
    ``metadata.shared``; the cubin's static figure is only the part the compiler reserves)."""
    usage = _cuobjdump(compiled, "--dump-resource-usage")
    field = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    sass = sass if sass is not None else sass_of(compiled)
    spills = sum(1 for _a, t in instructions(sass) if opcode(t).split(".")[0] in ("STL", "LDL"))
    return {"registers": field.get("REG"), "local_bytes": field.get("LOCAL"), "stack_bytes": field.get("STACK"),
            "spill_instructions": spills, "shared_bytes": int(compiled.metadata.shared)}


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction, in order."""
    return [(int(m.group(1), 16), m.group(2)) for m in _INSTRUCTION.finditer(sass)]


def opcode(text: str) -> str:
    """The full opcode (with modifiers, e.g. ``UTCOMMA.4X``) of one instruction, its predicate removed."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loop_texts(sass: str) -> list[list[str]]:
    """The instruction texts (operands included) of every loop body (see the module docstring), one
    list per backward branch, in address order."""
    ins = instructions(sass)
    out = []
    for addr, text in ins:
        m = _BACKWARD_BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            out.append([t for a, t in ins if int(m.group(1), 16) <= a <= addr])
    return out


def loops(sass: str) -> list[list[str]]:
    """The full opcodes of every loop body (see the module docstring), one list per backward branch."""
    return [[opcode(t) for t in body] for body in loop_texts(sass)]
