"""The channels file ``foursight_channels.json``: its format, its one reader and its one writer
(:class:`ChannelsFile`).

It holds, for each quantized module, the BF16 channel set and the calibrated FP4-part input amax.
``foursight quantize`` and ``import`` write one beside a checkpoint, ``foursight calibrate``
(:func:`foursight.checkpoint.calibrate_channels`) writes one alone, and online (load-time)
quantization in vLLM and SGLang reads it (:mod:`foursight.quant_methods.online`). The static
activation scale made from the amax is :func:`foursight.schema.static_input_scale`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from foursight import schema
from foursight.schema import CheckpointError

#: Version of ``foursight_channels.json``. Version 2: ``input_amax`` is the amax of the FP4 part
#: of the layer's input (the BF16 channels zeroed), the quantity a static ``input_global_scale``
#: is made from. Version 1 stored the amax over all channels; its channel sets are still read,
#: its ``input_amax`` is not (it gives a different scale than the checkpoint).
CHANNELS_FORMAT_VERSION = 2
_CHANNELS_KEYS = {"format_version", "channels", "input_amax"}


def check_channels_destination(path: str | os.PathLike) -> None:
    """A channels file is written to a file path: a folder there is refused (FileExistsError naming it)."""
    p = Path(path)
    if p.is_dir():
        raise FileExistsError(f"{p} is a folder; a channels file is written to a file path (e.g. {p / schema.CHANNELS_FILE}); nothing was written")


@dataclass
class ChannelsFile:
    """``foursight_channels.json``: the BF16 channel set and the calibrated FP4-part input amax
    of each quantized module, for online (load-time) quantization.

    Format: ``{"format_version": 2, "channels": {module: [indices]}, "input_amax": {module: float}}``.
    Rules (reading): a JSON object with no other keys; ``channels`` maps each module to a list of
    distinct non-negative integers (stored sorted); ``input_amax`` maps modules listed in
    ``channels`` to finite numbers ≥ 0. Every violation raises :class:`CheckpointError` naming
    the file and the field.

    Attributes:
        channels: module name -> sorted input-channel indices.
        input_amax: module name -> max |x| of the layer input with the BF16 channels zeroed.
        path: where it was read from or written to.
    """

    channels: dict[str, list[int]] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    path: str = ""
    format_version: int = CHANNELS_FORMAT_VERSION

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ChannelsFile":
        """Read and validate a channels file (a folder means its ``foursight_channels.json``)."""
        p = Path(path)
        if p.is_dir():
            p = p / schema.CHANNELS_FILE
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"channels file {p} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"channels file {p}: cannot read ({e})") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"channels file {p}: invalid JSON ({e})") from None
        return cls.from_dict(data, str(p))

    @classmethod
    def from_dict(cls, data: object, path: str = "<channels file>") -> "ChannelsFile":
        """Validate a decoded channels file (see the class docstring for the rules)."""
        where = f"channels file {path}"
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: expected a JSON object")
        version = data.get("format_version")
        if version not in (1, CHANNELS_FORMAT_VERSION) or isinstance(version, bool):
            raise CheckpointError(f"{where}: format_version {version!r}, expected {CHANNELS_FORMAT_VERSION}")
        unknown = set(data) - _CHANNELS_KEYS
        if unknown:
            raise CheckpointError(f"{where}: unknown key(s) {sorted(unknown)}")
        chans = data.get("channels")
        if not isinstance(chans, dict):
            raise CheckpointError(f"{where}: field 'channels' must be an object module -> [indices]")
        out: dict[str, list[int]] = {}
        for name, idx in chans.items():
            if not isinstance(idx, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in idx):
                raise CheckpointError(f"{where}: channels[{name!r}] must be a list of non-negative ints")
            if len(set(idx)) != len(idx):
                raise CheckpointError(f"{where}: channels[{name!r}] has repeated indices")
            out[name] = sorted(idx)
        amax = data.get("input_amax", {})
        if not isinstance(amax, dict):
            raise CheckpointError(f"{where}: field 'input_amax' must be an object module -> float")
        amax_out: dict[str, float] = {}
        for name, v in amax.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CheckpointError(f"{where}: input_amax[{name!r}] must be a finite number >= 0, got {v!r}")
            if name not in out:
                raise CheckpointError(f"{where}: input_amax[{name!r}] names a module missing from 'channels'")
            amax_out[name] = float(v)
        if version == 1:
            amax_out = {}  # version 1 amax is over all channels: not the scale the checkpoint uses
        return cls(out, amax_out, path, version)

    def record(self, names: "list[str] | tuple[str, ...]", channels: torch.Tensor, input_amax: float) -> None:
        """Enter one input group's choice: the channel set ``channels`` and the FP4-part amax ``input_amax``
        for each module of ``names`` (the members that share the input)."""
        for n in names:
            self.channels[n] = [int(c) for c in channels]
            self.input_amax[n] = float(input_amax)

    def to_dict(self) -> dict:
        return {"format_version": CHANNELS_FORMAT_VERSION, "channels": {n: [int(i) for i in v] for n, v in self.channels.items()},
                "input_amax": {n: float(v) for n, v in self.input_amax.items()}}

    def write(self, path: str | os.PathLike) -> Path:
        """Validate and write atomically (a temporary file beside ``path``, then renamed)."""
        data = self.to_dict()
        ChannelsFile.from_dict(data, str(path))
        p = Path(path)
        check_channels_destination(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)  # unique: concurrent writers never share it
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(data))
            os.chmod(tmp, 0o644)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.path = str(p)
        return p

    def channel_tensor(self, name: str) -> torch.Tensor | None:
        """int32 [k] channel set of module ``name`` (None when the file does not list it)."""
        idx = self.channels.get(name)
        return None if idx is None else torch.tensor(idx, dtype=torch.int32)

    def input_scale(self, names: "list[str]", layer: str = "layer") -> torch.Tensor:
        """:func:`static_input_scale` of the modules ``names`` (a fused layer's shards)."""
        missing = [n for n in names if n not in self.input_amax]
        if missing:
            hint = " (its format_version 1 amax is over all channels and is not used: re-run `foursight calibrate`)" if self.format_version == 1 else ""
            raise CheckpointError(f"{layer}: static activation scale requested but channels file {self.path} has no input_amax for {missing}{hint}")
        return schema.static_input_scale([self.input_amax[n] for n in names])
