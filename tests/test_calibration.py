"""Calibration statistics, channel selection and channel sharing across q/k/v and gate/up."""

from __future__ import annotations

import torch
from torch import nn

from foursight.calibration import ChannelStats, StatsCollector, group_key
from foursight.channels import select_channels, weight_based_channels


def test_welford_merge_matches_numpy_over_chunks():
    import numpy as np

    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(int(r), 8, generator=g) * 3 + 1 for r in (1, 5, 17, 2)]
    st = ChannelStats.empty(8)
    for c in chunks:
        st = st.update(c)
    allx = torch.cat(chunks).double().numpy()
    assert st.count == allx.shape[0]
    assert np.allclose(st.mean.numpy(), allx.mean(0), rtol=1e-12, atol=1e-12)
    assert np.allclose(st.variance.numpy(), allx.var(0), rtol=1e-10, atol=1e-12)
    assert np.allclose(st.amax.numpy(), np.abs(allx).max(0), rtol=1e-6)
    # merge is order-independent
    a = ChannelStats.from_rows(chunks[0]).merge(ChannelStats.from_rows(chunks[2]))
    b = ChannelStats.from_rows(chunks[2]).merge(ChannelStats.from_rows(chunks[0]))
    assert torch.allclose(a.variance, b.variance, rtol=1e-12)


def test_select_top_k_by_variance_sorted():
    var = torch.tensor([1.0, 9.0, 3.0, 9.0, 0.5, 7.0])
    assert select_channels(var, 3).tolist() == [1, 3, 5]
    assert select_channels(var, 0).numel() == 0
    w = torch.zeros(2, 6)
    w[0, 4] = 5
    w[1, 2] = -3
    assert weight_based_channels([w], 2).tolist() == [2, 4]


class _Block(nn.Module):
    """Attention-like and MLP-like projections reading shared inputs, as in HF Llama."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
        self.o_proj = nn.Linear(32, 32)
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        a = self.o_proj(self.q_proj(x) + torch.cat([self.k_proj(x), self.v_proj(x)], -1))
        h = x + a
        return h + self.down_proj(torch.relu(self.gate_proj(h)) * self.up_proj(h))


def test_groups_share_one_channel_set():
    torch.manual_seed(0)
    m = _Block()
    names = [n for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
    col = StatsCollector(m, names, keep_rows=64)
    with col, torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 7, 32)
            x[..., 5] *= 20
            col.set_mask(None)
            m(x)
    members = sorted(sorted(g.members) for g in col.groups.values())
    assert ["k_proj", "q_proj", "v_proj"] in members
    assert ["gate_proj", "up_proj"] in members
    assert ["o_proj"] in members and ["down_proj"] in members
    qkv = next(g for g in col.groups.values() if "q_proj" in g.members)
    assert qkv.stats.count == 3 * 4 * 7  # recorded once per pass, not three times
    assert 5 in select_channels(qkv.stats.variance, 2).tolist()
    assert qkv.rows is not None and qkv.rows.shape[1] == 32


def test_padding_rows_are_skipped():
    m = nn.Sequential(nn.Linear(16, 16))
    col = StatsCollector(m, ["0"])
    x = torch.ones(2, 3, 16)
    x[1, 2] = 1000.0  # a padded position
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with col, torch.no_grad():
        col.set_mask(mask)
        m(x)
    st = col.groups["0"].stats
    assert st.count == 5 and float(st.amax.max()) == 1.0


def test_moe_experts_group_by_name():
    assert group_key("model.layers.3.mlp.experts.7.gate_proj") == "model.layers.3.mlp.experts.gate_up"
    assert group_key("model.layers.3.mlp.experts.0.up_proj") == "model.layers.3.mlp.experts.gate_up"
    assert group_key("model.layers.3.mlp.experts.0.down_proj") == "model.layers.3.mlp.experts.down"
    assert group_key("model.layers.3.mlp.gate_proj") is None
