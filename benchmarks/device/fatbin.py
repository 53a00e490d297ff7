"""Keep only what one GPU architecture loads from a CUDA library's embedded fatbinaries.

A CUDA extension (``vllm/_C_stable_libtorch.abi3.so``) holds, in its ELF section ``.nv_fatbin``, one
fatbinary per compiled source file, each with machine code (SASS, an ELF image) for several
architectures and sometimes PTX. On a given card the driver loads, per fatbinary, the SASS built for
that card's architecture, else JIT-compiles the newest PTX it can. Everything else is dead weight for
a device call that carries the library: vLLM 0.26's core-ops library is 79 MB, 55.9 MB as xz, and only
about 13 MB of its 54 MB of fatbinaries serve an sm_90 card.

:func:`keep_arch` zeroes the payload of every entry the driver cannot choose for ``arch`` and leaves
the file's layout (sizes, offsets, headers) byte for byte as it was, so the dynamic loader and the CUDA
runtime see the same library; xz then compresses the zeroed entries to nothing (55.9 -> 14.8 MB).
Rule, per fatbinary: keep the SASS entries of ``arch``; if there is none, keep the newest PTX entry of
an architecture <= ``arch`` (the driver JIT-compiles it); zero every other entry. A fatbinary with
neither has no kernel this card could run before the trim either.

The fatbinary layout (NVIDIA does not document it; as read by cuobjdump-compatible tools): a header
``<IHHQ`` (magic 0xBA55ED50, version, header size, payload size), then entries, each a header whose
first fields are ``<HHIQ`` (kind 1 = PTX, 2 = SASS; version; header size; payload size) with the
architecture as a uint32 at offset 28.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_SASS = 1, 2


@dataclass(frozen=True)
class Entry:
    """One architecture's image inside one fatbinary."""

    fatbin: int  # file offset of the fatbinary that holds it
    payload: int  # file offset of the image's bytes
    size: int
    kind: int  # KIND_PTX or KIND_SASS
    arch: int  # e.g. 90 for sm_90 / compute_90


def section(data: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of the ELF64 little-endian section ``name``; ValueError if absent."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, base)
        off, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name_off, off, size
    _, str_off, _ = header(shstrndx)
    for i in range(shnum):
        name_off, off, size = header(i)
        end = data.index(b"\0", str_off + name_off)
        if data[str_off + name_off:end].decode() == name:
            return off, size
    raise ValueError(f"no ELF section {name!r}")


def entries(data: bytes) -> list[Entry]:
    """Every image of every fatbinary in the file's ``.nv_fatbin`` section."""
    off, size = section(data, ".nv_fatbin")
    out, p, end = [], off, off + size
    while p + 16 <= end:
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:  # alignment padding between fatbinaries
            p += 8
            continue
        q, stop = p + hsize, p + hsize + fsize
        while q < stop:
            kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            out.append(Entry(p, q + ehsize, psize, kind, arch))
            q += ehsize + psize
        p = stop
    return out


def chosen(images: list[Entry], arch: int) -> list[Entry]:
    """The images of one fatbinary the driver can load on an ``arch`` card (the module docstring's rule)."""
    sass = [e for e in images if e.kind == KIND_SASS and e.arch == arch]
    if sass:
        return sass
    ptx = [e for e in images if e.kind == KIND_PTX and e.arch <= arch]
    return [max(ptx, key=lambda e: e.arch)] if ptx else []


def keep_arch(src: Path, dst: Path, arch: int = 90) -> dict[str, int]:
    """Write ``src`` to ``dst`` with every image but ``arch``'s zeroed (same size, same layout).

    Returns byte counts: ``kept``, ``zeroed`` and ``fatbins`` (how many fatbinaries) for the log.
    """
    data = Path(src).read_bytes()
    buf = bytearray(data)
    found = entries(data)
    by_fatbin: dict[int, list[Entry]] = {}
    for e in found:
        by_fatbin.setdefault(e.fatbin, []).append(e)
    kept = zeroed = 0
    for images in by_fatbin.values():
        keep = set(chosen(images, arch))
        for e in images:
            if e in keep:
                kept += e.size
            else:
                buf[e.payload:e.payload + e.size] = bytes(e.size)
                zeroed += e.size
    Path(dst).write_bytes(bytes(buf))
    return {"kept": kept, "zeroed": zeroed, "fatbins": len(by_fatbin)}
