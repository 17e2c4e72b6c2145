"""The all-gather strategy and packed variable-length sequences (per-document sharding), on real
gloo ranks, against the float64 reference (per document for varlen): out, LSE and gradients."""

import itertools

import pytest
import torch

import cpattn
from cpattn.core.layout import LAYOUTS
from cpattn.testing.emulation import ring_attention_emulated

from conftest import assert_matches, seeded_problem
from distributed import run_ranks
from reference import reference_attention, varlen_reference
from tolerances import Tolerance

MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (7, 0)), (False, (4, 6))]


def _allgather_cases(rank: int, world: int) -> None:
    seqlen = 10 * world
    cases = itertools.product(LAYOUTS, MASKS, [(4, 4, None), (4, 2, 1), (4, 1, None)])
    for n, (layout, (causal, window), (h, hkv, chunk)) in enumerate(cases):
        dtype = torch.bfloat16 if n % 5 == 0 else torch.float32
        (q, k, v, dout), ref_out, ref_lse, ref_in, tol = seeded_problem(n, seqlen, h, hkv, dtype,
                                                                   causal, window)
        shards = [cpattn.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.ring_attention(*shards, causal=causal, window=window, layout=layout,
                                         strategy="allgather", allgather_chunk=chunk,
                                         return_lse=True)
        out.backward(cpattn.shard(dout, layout=layout))
        un = lambda t, d=1: cpattn.unshard(t, layout=layout, dim=d)  # noqa: E731
        assert_matches(f"allgather W={world} {layout} causal={causal} {window} {h}/{hkv} "
                       f"chunk={chunk} {dtype}", un(out.detach()), un(lse.detach(), 2),
                       [un(s.grad) for s in shards], ref_out, ref_lse, [r.grad for r in ref_in],
                       tol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_allgather_matches_reference(world):
    run_ranks(world, _allgather_cases)


def _varlen_cases(rank: int, world: int) -> None:
    for n, (layout, (causal, window), strategy) in enumerate(
        itertools.product(LAYOUTS, MASKS, ["ring", "allgather"])
    ):
        gen = torch.Generator().manual_seed(100 + n)
        # documents shorter than W, one empty document, and longer ones
        lengths = [1, 0, int(torch.randint(2, 4 * world + 3, (1,), generator=gen)), world + 1,
                   int(torch.randint(1, 3 * world, (1,), generator=gen))]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        total = int(cu[-1])
        q, k, v, dout = (torch.randn(total, 4 if i != 1 and i != 2 else 2, 16, generator=gen)
                         for i in range(4))
        ref_out, ref_lse, ref_grads, _ = varlen_reference(q, k, v, dout, lengths, causal, window)
        shards = [cpattn.shard_varlen(t, cu, layout=layout).requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.ring_attention_varlen(*shards, cu, causal=causal, window=window,
                                                layout=layout, strategy=strategy,
                                                return_lse=True)
        assert not out.isnan().any() and not lse.isnan().any()
        index, _ = cpattn.positions_varlen(cu, layout=layout)
        pad = index < 0
        assert (out[pad] == 0).all() and (lse[:, pad] == float("-inf")).all(), "padding rows"
        out.backward(cpattn.shard_varlen(dout, cu, layout=layout))
        un = lambda t, d=0: cpattn.unshard_varlen(t, cu, layout=layout, dim=d)  # noqa: E731
        assert_matches(f"varlen W={world} {layout} {strategy} causal={causal} {window} "
                       f"docs={lengths}", un(out.detach()), un(lse.detach(), 1),
                       [un(s.grad) for s in shards], ref_out, ref_lse, ref_grads,
                       Tolerance())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_varlen_matches_per_document_reference(world):
    run_ranks(world, _varlen_cases)


def _varlen_disagreement(rank: int, world: int) -> None:
    cu = torch.tensor([0, 4, 8 + 2 * rank])  # ranks disagree on the documents
    x = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="ranks disagree on"):
        cpattn.ring_attention_varlen(x, x, x, cu, timeout=20)
    bad = torch.randn(5, 2, 16)  # wrong local length for these documents
    cu = torch.tensor([0, 4, 8])
    with pytest.raises(RuntimeError, match="every rank holds"):
        cpattn.ring_attention_varlen(bad, bad, bad, cu, timeout=20)
    with pytest.raises(ValueError, match="strategy"):
        cpattn.ring_attention_varlen(x, x, x, cu, strategy="magic")


def test_varlen_bad_input_raises_on_every_rank():
    run_ranks(2, _varlen_disagreement)


def test_pad_documents():
    x = torch.arange(7.0)[:, None]
    padded, cu = cpattn.pad_documents(x, [0, 3, 3, 7], multiple=4)
    assert cu.tolist() == [0, 4, 4, 8]
    assert padded[:, 0].tolist() == [0, 1, 2, 0, 3, 4, 5, 6]


@pytest.mark.parametrize("strategy,layout", [("ring", "zigzag"), ("allgather", "striped"),
                                             ("allgather", "zigzag"),
                                             ("ulysses", "contiguous")])
@pytest.mark.parametrize("world", [3, 4])
def test_emulated_strategies_match_reference(strategy, layout, world):
    torch.manual_seed(world)
    seqlen = 8 * world
    q = torch.randn(1, seqlen, 12, 16)
    k, v = (torch.randn(1, seqlen, 2, 16) for _ in range(2))
    ref_out, ref_lse = reference_attention(q, k, v, causal=True, window=(9, 0))
    pos = [cpattn.positions(seqlen, layout=layout, rank=r, world_size=world) for r in range(world)]
    outs, lses = ring_attention_emulated(
        [q[:, p] for p in pos], [k[:, p] for p in pos], [v[:, p] for p in pos], causal=True,
        window=(9, 0), layout=layout, strategy=strategy)
    for o, lse, p in zip(outs, lses, pos):
        torch.testing.assert_close(o.double(), ref_out[:, p], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse[:, :, p], atol=2e-5, rtol=2e-5)
