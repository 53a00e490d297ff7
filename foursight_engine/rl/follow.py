"""Does the rollout engine follow the learner? Code flips and update alignment per weight sync.

QuRL (ICLR'26) found that per-step RL updates are often too small to survive quantization: the
learner moves, the 4-bit rollout weights do not. Per sync this module measures, over the rollout
engine's linear layers (``lm_head`` excluded):

* ``follow/code_flip_fraction`` — the share of quantized weight codes (NVFP4 E2M1 nibbles outside
  the BF16 channel columns, or FP8 bytes) that changed in this sync;
* ``follow/bf16_flip_fraction`` — the share of BF16 weight elements (carved-out layers, BF16
  channel columns, the BF16 engine) whose bits changed;
* ``follow/cos`` — cos(ΔW_rollout, ΔW_learner) over all these layers at once, where ΔW_rollout is
  the change of the rollout's effective (dequantized) weights and ΔW_learner the change of the
  learner's FP32 master weights since the previous sync (None while the learner has not moved);
* ``follow/norm_ratio`` — ‖ΔW_rollout‖ / ‖ΔW_learner‖, and ``follow/learner_rel_update`` —
  ‖ΔW_learner‖ / ‖W_learner‖.

Everything is computed on the weights' device with one host transfer per sync (the totals).
The first sync of a run (and the first after a ``--resume``) has no previous snapshot of the
learner's moved weights, so its ``follow/cos`` is None.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_EMPTY = torch.zeros(0)


def _layer_state(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(quantized codes or empty, BF16 codes (int16 bits) or empty, effective fp32 weight) of one rollout linear:
    a layer that holds a :class:`~foursight.layer.QuantizedWeight` as ``qweight`` (the HF engine's
    ``FourSightLinear``), an :class:`~foursight.fp8.Fp8Linear` or an ``nn.Linear``."""
    from foursight.fp8 import Fp8Linear, dequantize_rowwise
    from foursight.layer import QuantizedWeight, dequantize_weight

    qw = getattr(mod, "qweight", None)
    if isinstance(qw, QuantizedWeight):
        packed = qw.weight_packed
        # the BF16 channel columns hold code 0 in every sync (zeroed before quantization): they never
        # flip and are left out of the count of codes (FollowTracker.update), with no masking here
        codes = torch.stack((packed & 0x0F, packed >> 4), -1).reshape(packed.shape[0], -1)
        return codes, qw.weight_bf16.view(torch.int16).clone(), dequantize_weight(qw, torch.float32)
    if isinstance(mod, Fp8Linear):
        return mod.weight_fp8.view(torch.uint8).clone(), _EMPTY, dequantize_rowwise(mod.weight_fp8, mod.weight_scale)
    if isinstance(mod, nn.Linear):
        w = mod.weight.detach().to(torch.bfloat16)
        return _EMPTY, w.view(torch.int16).clone(), w.float()
    return None


class FollowTracker:
    """Snapshots of the rollout's and the learner's linear weights at each sync; :meth:`update`
    returns the ``follow/*`` metrics of the change since the previous call."""

    def __init__(self, ignore=("lm_head",)):
        from foursight.schema import FourSightConfig

        self._ignore = FourSightConfig(ignore=list(ignore))
        self._prev: dict[str, tuple] | None = None

    def _snapshot(self, rollout: nn.Module, learner: nn.Module) -> dict[str, tuple]:
        lmods = dict(learner.named_modules())
        out = {}
        for name, mod in rollout.named_modules():
            if self._ignore.is_ignored(name) or name not in lmods:
                continue
            st = _layer_state(mod)
            if st is not None:
                out[name] = (*st, lmods[name].weight.detach().float().clone())
        return out

    @torch.no_grad()
    def update(self, rollout: nn.Module, learner: nn.Module) -> dict[str, Any]:
        cur = self._snapshot(rollout, learner)
        prev, self._prev = self._prev, cur
        if prev is None:
            return {}
        dev = next(iter(cur.values()))[2].device
        acc = torch.zeros(8, dtype=torch.float64, device=dev)
        n_q = n_b = 0
        for name, (q, b, w_r, w_l) in cur.items():
            pq, pb, pw_r, pw_l = prev[name]
            dr, dl = w_r - pw_r, w_l.to(dev) - pw_l.to(dev)
            acc += torch.stack([(q != pq).sum().double() if q.numel() else acc.new_zeros(()),
                                (b != pb).sum().double() if b.numel() else acc.new_zeros(()),
                                (dr.double() * dl.double()).sum(), dr.double().pow(2).sum(), dl.double().pow(2).sum(),
                                w_l.double().pow(2).sum().to(dev), acc.new_zeros(()), acc.new_zeros(())])
            n_q += q.numel() - b.numel() if q.numel() else 0  # FP4 codes outside the k BF16 columns: N·(K − k)
            n_b += b.numel()
        flips_q, flips_b, dot, nr2, nl2, wl2, _, _ = acc.tolist()
        out: dict[str, Any] = {
            "follow/code_flip_fraction": flips_q / n_q if n_q else None,
            "follow/bf16_flip_fraction": flips_b / n_b if n_b else None,
            "follow/learner_rel_update": (nl2 / wl2) ** 0.5 if wl2 else None,
        }
        if nl2 > 0:
            out["follow/cos"] = dot / ((nr2 * nl2) ** 0.5) if nr2 > 0 else 0.0
            out["follow/norm_ratio"] = (nr2 / nl2) ** 0.5
        else:
            out["follow/cos"] = out["follow/norm_ratio"] = None
        return out
