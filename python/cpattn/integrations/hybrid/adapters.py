"""The adapters: each mixer class's forward written against the module's own submodules and
parameters (projections, gates, norms, out_proj), with the convolution (`Mixing.conv`: its halo)
and the recurrence (`Mixing.scalar_decay`, `.delta_rule`, `.kda`, `.selective_scan`: the
blocks of cpattn.mixers.kernels with the state scan, fp32) over this rank's tokens. One
`@adapts` line per class; variants are read from the module's own submodules, buffers and
config values (Falcon-H1's multipliers and optional norm, the RMSNorms of Jamba and FalconMamba
on dt / B / C, OLMo's beta x2), never from its class name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

from cpattn.integrations.hybrid.registry import adapts
from cpattn.mixers.mixing import Mixing


def _own(module: torch.nn.Module, name: str) -> Optional[object]:
    """The module's own submodule, buffer or parameter `name` (not an attribute of its class, nor
    of a child), or None."""
    for table in (module._modules, module._buffers, module._parameters):
        if table.get(name) is not None:
            return table[name]
    return None


def _act(name):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _tokens(h: torch.Tensor, fn: Callable):
    """fn(h) for a per-token function of the module's own (its reshapes cannot infer a head
    count from no tokens: a rank holding none runs it on one zero token, then keeps none)."""
    if h.shape[1]:
        return fn(h)
    out = fn(torch.cat([h, h.new_zeros((h.shape[0], 1, *h.shape[2:]))], 1))
    return tuple(t[:, :0] for t in out) if isinstance(out, tuple) else out[:, :0]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@adapts("lfm2.Lfm2ShortConv",
        "lfm2_moe.Lfm2MoeShortConv")
def short_conv(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """LFM2: y = C * conv(B * x), then out_proj (Lfm2ShortConv, Lfm2MoeShortConv)."""
    b, c, x = m.in_proj(h).chunk(3, dim=-1)
    return m.out_proj(c * mix.conv(b * x, m.conv))


@adapts("mamba2.Mamba2Mixer",
        "bamba.BambaMixer",
        "granitemoehybrid.GraniteMoeHybridMambaLayer",
        "nemotron_h.NemotronHMamba2Mixer",
        "zamba2.Zamba2MambaMixer",
        "falcon_h1.FalconH1Mixer")
def mamba2(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Mamba-2 (SSD: a scalar decay per head): Mamba2Mixer, BambaMixer,
    GraniteMoeHybridMambaLayer, NemotronHMamba2Mixer, Zamba2MambaMixer, and FalconH1Mixer with
    its multipliers and optional norm."""
    multipliers = _own(m, "mup_vector")  # (Falcon-H1: muP multipliers of the projections)
    dtype = h.dtype
    if multipliers is not None:
        h = h * m.ssm_in_multiplier
    projected = m.in_proj(h)
    if multipliers is not None:
        projected = projected * multipliers
    gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    xbc = m.act(mix.conv(xbc, m.conv1d))
    groups_state = (xbc.shape[-1] - m.intermediate_size) // 2
    x, b, c = xbc.split([m.intermediate_size, groups_state, groups_state], dim=-1)
    heads, groups = m.num_heads, m.n_groups
    dt = F.softplus(dt + m.dt_bias.to(dt.dtype)).clamp(*m.time_step_limit).float()
    a = -torch.exp(m.A_log.float())
    x = x.unflatten(-1, (heads, -1)).float()  # (unflatten: also for a rank without tokens)
    b, c = (t.unflatten(-1, (groups, -1)).float()
            .repeat_interleave(heads // groups, dim=2) for t in (b, c))
    y = mix.scalar_decay(c, b, x * dt[..., None], a * dt) + m.D.float()[:, None] * x
    y = y.flatten(-2)
    if isinstance(m.norm, torch.nn.Identity):  # (Falcon-H1 without mamba_rms_norm)
        y = y * F.silu(gate)
    else:
        y = m.norm(y, gate)
    return m.out_proj(y.to(dtype))


def _delta_rule(m, h, mix: Mixing, mixed, z, b, a, beta_scale: float = 1.0):
    """The gated delta rule on the projections (Qwen3-Next, Qwen3.5, OLMo-Hybrid): conv + SiLU,
    l2-normalised q and k, decay g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    batch, length = h.shape[:2]
    mixed = _act(m.activation)(mix.conv(mixed, m.conv1d))
    q, k, v = mixed.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q, k = (t.unflatten(-1, (-1, m.head_k_dim)) for t in (q, k))
    v = v.unflatten(-1, (-1, m.head_v_dim))
    beta = b.sigmoid() * beta_scale
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    repeat = m.num_v_heads // m.num_k_heads
    q, k = (t.repeat_interleave(repeat, dim=2).float() for t in (q, k))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    return mix.delta_rule(q, k, v.float(), g, beta.float()).to(h.dtype), z


@adapts("qwen3_5.Qwen3_5GatedDeltaNet",
        "qwen3_5_moe.Qwen3_5MoeGatedDeltaNet")
def gated_delta_split(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet: separate qkv / z / b / a projections."""
    batch, length = h.shape[:2]
    z = m.in_proj_z(h).unflatten(-1, (-1, m.head_v_dim))
    y, z = _delta_rule(m, h, mix, m.in_proj_qkv(h), z, m.in_proj_b(h), m.in_proj_a(h))
    y = m.norm(y.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(y.reshape(batch, length, m.value_dim))


@adapts("qwen3_next.Qwen3NextGatedDeltaNet")
def gated_delta_fused(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Qwen3NextGatedDeltaNet: the fused in_proj_qkvz / in_proj_ba, split by the module's own
    fix_query_key_value_ordering."""
    batch, length = h.shape[:2]
    q, k, v, z, b, a = _tokens(h, lambda t: m.fix_query_key_value_ordering(m.in_proj_qkvz(t),
                                                                           m.in_proj_ba(t)))
    mixed = torch.cat([t.flatten(-2) for t in (q, k, v)], dim=-1)
    y, z = _delta_rule(m, h, mix, mixed, z, b, a)
    y = m.norm(y.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(y.reshape(batch, length, m.value_dim))


@adapts("olmo_hybrid.OlmoHybridGatedDeltaNet")
def gated_delta_olmo(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """OlmoHybridGatedDeltaNet: q / k / v / a / b / g projections, beta x2 with negative
    eigenvalues allowed."""
    batch, length = h.shape[:2]
    mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
    y, _ = _delta_rule(m, h, mix, mixed, None, m.b_proj(h), m.a_proj(h),
                       2.0 if m.allow_neg_eigval else 1.0)
    gate = m.g_proj(h)
    y = m.o_norm(y.reshape(-1, m.head_v_dim), gate.reshape(-1, m.head_v_dim))
    return m.o_proj(y.reshape(batch, length, m.value_dim))


@adapts("kimi_linear.KimiLinearDeltaAttention")
def kimi_delta(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """KimiLinearDeltaAttention: the delta rule with a decay per key channel (the module's own
    forget_gate), gated RMSNorm output."""
    mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
    mixed = _act(m.activation)(mix.conv(mixed, m.conv1d))
    q, k, v = (t.unflatten(-1, (-1, m.head_dim)).float()
               for t in mixed.split([m.qkv_dim] * 3, dim=-1))
    g = _tokens(h, m.forget_gate).float()
    beta = torch.sigmoid(m.b_proj(h)).float()
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    y = mix.kda(q, k, v, g, beta).to(h.dtype)
    gate = m.g_b_proj(m.g_a_proj(h)).unflatten(-1, (-1, m.head_dim))
    return m.o_proj(m.o_norm(y, gate).flatten(-2))


@adapts("minimax.MiniMaxLightningAttention", position_embeddings=None, attention_mask=None)
def lightning(m, h: torch.Tensor, mix: Mixing):
    """MiniMaxLightningAttention: linear attention with a constant decay per head
    exp(-slope_rate); returns (out, None) like the module (its second output, the final state,
    is not used in training)."""
    batch, length = h.shape[:2]
    heads, d = m.num_attention_heads, m.head_dim
    qkv = m.act_fn(m.qkv_proj(h)).reshape(batch, length, heads, 3 * d)
    q, k, v = (t.float() for t in qkv.split(d, dim=-1))
    decay = (-m.slope_rate.reshape(heads).float()).expand(batch, length, heads)
    y = mix.scalar_decay(q, k, v, decay)
    y = m.norm(y.reshape(batch, length, heads * d).to(h.dtype))
    y = torch.sigmoid(m.output_gate(h)) * y
    return m.out_proj(y), None


@adapts("mamba.MambaMixer",
        "falcon_mamba.FalconMambaMixer",
        "jamba.JambaMambaMixer")
def mamba1(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Mamba (a decay per channel and state entry): MambaMixer, and FalconMambaMixer and
    JambaMambaMixer with their RMSNorms on dt, B and C."""
    dtype = h.dtype
    x, gate = m.in_proj(h).chunk(2, dim=-1)
    x = m.act(mix.conv(x, m.conv1d))
    step, b, c = m.x_proj(x).split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size],
                                   dim=-1)
    norms = [_own(m, n) for n in ("dt_layernorm", "b_layernorm", "c_layernorm")]
    if all(n is not None for n in norms):  # (Jamba, FalconMamba: RMSNorms on dt, B and C)
        step, b, c = (n(t) for n, t in zip(norms, (step, b, c)))
    # dt, the state's readout and the gate in the dtypes the module has them (bf16 under
    # autocast), the scan in fp32
    dt = step @ m.dt_proj.weight.t()
    if m.dt_proj.bias is not None:
        dt = dt + m.dt_proj.bias.to(dt.dtype)
    dt = F.softplus(dt)
    a = -torch.exp(m.A_log.float())  # (I, N)
    y = mix.selective_scan(dt, a, x, b, c).to(x.dtype) + x * m.D.float()
    y = y * F.silu(gate)
    return m.out_proj(y.to(dtype))
