"""merge_state_: the -inf safe LSE merge, alone and as the glue between key blocks."""

from __future__ import annotations

import itertools

import pytest
import torch

import cpattn

from conftest import assert_close_fp32, make_qkv, op_options, randn, reference_with_grads
from reference import Window, reference_attention

ops = torch.ops.cpattn
NEG_INF = float("-inf")


def reference_merge(
    out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge in float64: lse = logaddexp(lse_a, lse_b), out = w_a out_a + w_b out_b."""
    la, lb = lse.double(), part_lse.double()
    both_empty = torch.isneginf(la) & torch.isneginf(lb)
    new_lse = torch.logaddexp(la, lb).masked_fill(both_empty, NEG_INF)
    safe = new_lse.masked_fill(both_empty, 0.0)
    w_a = torch.exp(la - safe).masked_fill(both_empty, 0.0)
    w_b = torch.exp(lb - safe).masked_fill(both_empty, 0.0)
    # lse is (B, H, S), out (B, S, H, D)
    new_out = w_a.transpose(1, 2)[..., None] * out.double()
    new_out = new_out + w_b.transpose(1, 2)[..., None] * part_out.double()
    return new_out, new_lse


def random_state(
    shape: tuple[int, int, int, int],
    gen: torch.Generator,
    empty_fraction: float,
    lse_center: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (out, lse) state; a fraction of rows is empty (out 0, lse -inf)."""
    b, s, h, _ = shape
    out = randn(shape, gen).to(dtype)
    lse = randn((b, h, s), gen) * 3 + lse_center
    empty = torch.rand((b, h, s), generator=gen) < empty_fraction
    lse = lse.masked_fill(empty, NEG_INF)
    out = out.masked_fill(empty.transpose(1, 2)[..., None], 0.0)
    return out, lse


@pytest.mark.parametrize("empty_fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_matches_formula(
    empty_fraction: float, part_dtype: torch.dtype, gen: torch.Generator
) -> None:
    """Random states, some rows empty on one side or both; part_out in any float dtype."""
    shape = (2, 5, 3, 40)  # distinct B, S, H: an index mix-up between (B,S,H) and (B,H,S) shows
    out, lse = random_state(shape, gen, empty_fraction)
    part_out, part_lse = random_state(shape, gen, empty_fraction, dtype=part_dtype)
    want_out, want_lse = reference_merge(out, lse, part_out, part_lse)
    cpattn.merge_state_(out, lse, part_out, part_lse)
    assert_close_fp32(out, want_out, "out")
    assert_close_fp32(lse, want_lse, "lse")


def test_merge_empty_cases_exact(gen: torch.Generator) -> None:
    """Both sides empty: (0, -inf), no NaN. One side empty: the other side, exactly."""
    shape = (1, 6, 2, 16)
    out, lse = random_state(shape, gen, 0.0)
    part_out, part_lse = random_state(shape, gen, 0.0)
    # rows 0-1: both empty; rows 2-3: only the running state empty; rows 4-5: only the part.
    for rows in (slice(0, 2), slice(2, 4)):
        lse[:, :, rows] = NEG_INF
        out[:, rows] = 0
    for rows in (slice(0, 2), slice(4, 6)):
        part_lse[:, :, rows] = NEG_INF
        part_out[:, rows] = 0
    out0, lse0 = out.clone(), lse.clone()
    cpattn.merge_state_(out, lse, part_out, part_lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:, 0:2], torch.zeros_like(out[:, 0:2]))
    assert torch.all(torch.isneginf(lse[:, :, 0:2]))
    assert torch.equal(out[:, 2:4], part_out[:, 2:4])
    assert torch.equal(lse[:, :, 2:4], part_lse[:, :, 2:4])
    assert torch.equal(out[:, 4:6], out0[:, 4:6])
    assert torch.equal(lse[:, :, 4:6], lse0[:, :, 4:6])


@pytest.mark.parametrize("center", [-300.0, 100.0, 1000.0, 1e4])
def test_merge_large_magnitude(center: float, gen: torch.Generator) -> None:
    """LSE values whose exp overflows (or underflows) fp32 merge stably."""
    shape = (1, 9, 2, 32)
    out, lse = random_state(shape, gen, 0.0, lse_center=center)
    part_out, part_lse = random_state(shape, gen, 0.0, lse_center=center)
    want_out, want_lse = reference_merge(out, lse, part_out, part_lse)
    cpattn.merge_state_(out, lse, part_out, part_lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close_fp32(out, want_out, "out")
    # fp32 spacing at |lse| ~ 1e4 is ~1e-3: compare relative to the magnitude.
    assert (lse.double() - want_lse).abs().max().item() <= 1e-6 * abs(center) + 1e-5


def test_merge_is_in_place(gen: torch.Generator) -> None:
    """out and lse are updated in place (same storage); the parts are left untouched."""
    shape = (2, 4, 3, 8)
    out, lse = random_state(shape, gen, 0.2)
    part_out, part_lse = random_state(shape, gen, 0.2)
    ptrs = (out.data_ptr(), lse.data_ptr())
    parts = (part_out.clone(), part_lse.clone())
    want_out, want_lse = reference_merge(out, lse, part_out, part_lse)
    alias = out.view(-1)
    result = cpattn.merge_state_(out, lse, part_out, part_lse)
    assert result is None
    assert (out.data_ptr(), lse.data_ptr()) == ptrs
    assert torch.equal(alias.view(shape), out)
    assert_close_fp32(out, want_out, "out")
    assert_close_fp32(lse, want_lse, "lse")
    assert torch.equal(part_out, parts[0]) and torch.equal(part_lse, parts[1])


def test_merge_non_contiguous_parts(gen: torch.Generator) -> None:
    """part_out and part_lse may be strided views (out and lse must be contiguous)."""
    b, s, h, d = 2, 7, 3, 16
    out, lse = random_state((b, s, h, d), gen, 0.1)
    part_out = randn((b, h, s, d), gen).transpose(1, 2)
    part_lse = randn((b, s, h), gen).transpose(1, 2)
    assert not part_out.is_contiguous() and not part_lse.is_contiguous()
    want_out, want_lse = reference_merge(out, lse, part_out, part_lse)
    cpattn.merge_state_(out, lse, part_out, part_lse)
    assert_close_fp32(out, want_out, "out")
    assert_close_fp32(lse, want_lse, "lse")


# ---------------------------------------------------------------------------------------------
# Attention over a split of the keys, merged, equals attention over all keys


def empty_state(b: int, s: int, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of a row that has seen no key yet."""
    return torch.zeros(b, s, h, d), torch.full((b, h, s), NEG_INF)


def random_cuts(n: int, pieces: int, gen: torch.Generator) -> list[int]:
    """Sorted cut points 0 = c0 < c1 < ... < c_pieces = n (chunks may differ in size)."""
    inner = torch.randperm(n - 1, generator=gen)[: pieces - 1] + 1
    return [0, *sorted(inner.tolist()), n]


SPLIT_MASKS: list[tuple[bool, Window]] = [
    (False, (-1, -1)),
    (True, (-1, -1)),
    (True, (40, -1)),
    (False, (25, 10)),
]


@pytest.mark.parametrize("pieces", [2, 3, 5])
@pytest.mark.parametrize("causal, window", SPLIT_MASKS)
def test_split_keys_merge_forward_and_backward(
    pieces: int, causal: bool, window: Window, gen: torch.Generator
) -> None:
    """Key chunks run with their k_offset and merged in random order equal the full attention;
    backward per chunk from the *global* out / lse sums to the full gradients."""
    b, sq, sk, h, hkv, d = 2, 70, 150, 4, 2, 32
    q, k, v = make_qkv(gen, b, sq, sk, h, hkv, d)
    dout = randn(q.shape, gen)
    scale, q_off = 0.2, sk - sq
    wl, wr = window
    cuts = random_cuts(sk, pieces, gen)
    chunks = list(itertools.pairwise(cuts))

    out, lse = empty_state(b, sq, h, d)
    for i in torch.randperm(len(chunks), generator=gen).tolist():
        c0, c1 = chunks[i]
        part = ops.attention_fwd(
            q, k[:, c0:c1], v[:, c0:c1], q_off, c0, **op_options(scale, causal, (wl, wr))
        )
        cpattn.merge_state_(out, lse, *part)

    r_out, r_lse, r_dq, r_dk, r_dv = reference_with_grads(
        q, k, v, dout, causal=causal, window=window, scale=scale
    )
    assert_close_fp32(out, r_out, "merged out")
    assert_close_fp32(lse, r_lse, "merged lse")

    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for c0, c1 in chunks:
        dq_c, dk_c, dv_c = ops.attention_bwd(
            dout, q, k[:, c0:c1], v[:, c0:c1], out, lse, q_off, c0,
            **op_options(scale, causal, (wl, wr)),
        )
        dq += dq_c
        dks.append(dk_c)
        dvs.append(dv_c)
    assert_close_fp32(dq, r_dq, "dq")
    assert_close_fp32(torch.cat(dks, 1), r_dk, "dk")
    assert_close_fp32(torch.cat(dvs, 1), r_dv, "dv")


def test_random_key_subsets_merge_without_mask(gen: torch.Generator) -> None:
    """Without a mask positions do not matter: any disjoint split of the keys merges exactly."""
    q, k, v = make_qkv(gen, 1, 40, 90, 2, 1, 64)
    perm = torch.randperm(90, generator=gen)
    set_a, set_b = perm[:33], perm[33:]
    out, lse = ops.attention_fwd(q, k[:, set_a], v[:, set_a], 0, 0, softmax_scale=0.125)
    part = ops.attention_fwd(q, k[:, set_b], v[:, set_b], 0, 0, softmax_scale=0.125)
    cpattn.merge_state_(out, lse, *part)
    r_out, r_lse = reference_attention(q, k, v, scale=0.125)
    assert_close_fp32(out, r_out, "out")
    assert_close_fp32(lse, r_lse, "lse")


def test_merge_low_precision_parts_with_fp32_state(gen: torch.Generator) -> None:
    """fp16 chunks kept in fp32 (out_dtype) and merged in fp32 are fp32-accurate (fp16 runs in
    fp32 from exactly upcast inputs); merging the fp16-rounded part_out directly is accepted and
    within fp16 rounding."""
    q, k, v = make_qkv(gen, 1, 50, 120, 2, 2, 64, dtype=torch.float16)
    r_out, r_lse = reference_attention(q, k, v, causal=True, q_offset=70)
    cuts = [0, 45, 120]

    out, lse = empty_state(1, 50, 2, 64)
    out_lp, lse_lp = empty_state(1, 50, 2, 64)
    part_max = 0.0
    for c0, c1 in itertools.pairwise(cuts):
        args = (q, k[:, c0:c1], v[:, c0:c1], 70, c0)
        part = ops.attention_fwd(*args, torch.float32, softmax_scale=0.125, causal=True)
        part_max = max(part_max, part[0].abs().max().item())
        cpattn.merge_state_(out, lse, *part)
        part_lp = ops.attention_fwd(*args, None, softmax_scale=0.125, causal=True)
        assert part_lp[0].dtype == torch.float16
        cpattn.merge_state_(out_lp, lse_lp, *part_lp)
    assert out.dtype == torch.float32
    # reference_attention's default scale is 1/sqrt(64) = 0.125 as well
    assert_close_fp32(out, r_out, "fp32 merge")
    assert_close_fp32(lse, r_lse, "lse")
    # Each part is rounded once (relative error <= 2^-11); the merge is a convex combination.
    err = (out_lp.double() - r_out).abs().max().item()
    assert err <= 2 * 2.0**-11 * part_max + 1e-4
