"""ring_attention_varlen over a cpattn.DocumentPlan, on real gloo ranks, against the float64
reference per document: documents whole on a rank, split over every rank and split over a
subset of the ranks (the all-to-all exchange), every score option, GQA, fp32 and bf16, forward,
LSE and every gradient (the sinks' summed over the ranks); a rank without tokens; the plan's
properties (balance, bytes, determinism, every token held once); torch.compile."""

import itertools

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.sharding.documents import visible_pairs
from cpattn.testing.distributed import run_ranks

from reference import varlen_reference
from tolerances import expected_of, tolerance

# One mix with a document too heavy for one rank of three or four, so that some documents
# are split over a subset of the ranks (checked below), plus short ones, a 1-token one and an
# empty one.
MIX = [300, 250, 7, 1, 0, 90, 40, 5, 120, 260, 33]


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _reference(q, k, v, dout, lengths, causal, window, kwargs, prefixes,
               compute_dtype=torch.float64):
    """float64 (or compute_dtype) attention of each document alone: out, lse, (dq, dk, dv),
    dsinks."""
    extra = {key: val for key, val in kwargs.items() if key != "sinks"}
    if "alibi_slopes" in extra:
        extra["alibi_slopes"] = extra["alibi_slopes"].double()
    if "softmax_scale" in extra:
        extra["scale"] = extra.pop("softmax_scale")
    return varlen_reference(q, k, v, dout, lengths, causal, window, sinks=kwargs.get("sinks"),
                            prefix_len=prefixes, compute_dtype=compute_dtype, **extra)


CASES = [  # (dtype, heads / kv heads, causal, window, options, prefix, strategy)
    (torch.float32, (4, 2), True, (-1, -1), {}, None, "ring"),
    (torch.float32, (4, 1), True, (7, 0), {"softcap": 5.0}, None, "allgather"),
    (torch.float32, (4, 4), False, (4, 6), {"softmax_scale": 0.3}, None, "auto"),
    (torch.float32, (4, 2), True, (-1, -1), {"sinks": True, "alibi_slopes": True}, "int",
     "ring"),
    (torch.float32, (4, 2), True, (-1, -1), {}, "per-document", "allgather"),
    (torch.bfloat16, (4, 2), True, (-1, -1), {"sinks": True}, None, "ring"),
]


def _plan_cases(rank, world):
    subsets = 0  # documents split over a subset of the ranks, over all cases
    for n, (dtype, (h, hkv), causal, window, opts, prefix, strategy) in enumerate(CASES):
        gen = torch.Generator().manual_seed(10 + n)
        lengths = MIX
        total = sum(lengths)
        # rounded to the run's dtype before the reference: it sees the values cpattn sees
        q, dout = (torch.randn(total, h, 16, generator=gen).to(dtype) for _ in range(2))
        k, v = (torch.randn(total, hkv, 16, generator=gen).to(dtype) for _ in range(2))
        kwargs = {}
        if opts.get("sinks"):
            kwargs["sinks"] = torch.randn(h, generator=gen)
        if opts.get("alibi_slopes"):
            kwargs["alibi_slopes"] = torch.rand(h, generator=gen)
        kwargs.update({key: val for key, val in opts.items()
                       if key not in ("sinks", "alibi_slopes")})
        prefixes = torch.zeros(len(lengths), dtype=torch.int64)
        prefix_arg = 0
        if prefix == "int":
            prefix_arg = 6
            prefixes = torch.tensor([min(6, n) for n in lengths])
        elif prefix == "per-document":
            prefixes = torch.tensor([n // 3 for n in lengths])
            prefix_arg = prefixes
        ref_out, ref_lse, ref_grads, ref_dsinks = _reference(q, k, v, dout, lengths, causal,
                                                             window, kwargs, prefixes)
        plan = cpattn.shard_documents(_cu(lengths), causal=causal, window=window,
                                      prefix_len=prefix_arg, split="balanced")
        subsets += sum(1 < len(m) < world for m in plan.spans)
        shards = [plan.shard(t, rank).to(dtype).requires_grad_() for t in (q, k, v)]
        if "sinks" in kwargs:
            kwargs["sinks"] = kwargs["sinks"].clone().requires_grad_()
        out, lse = cpattn.ring_attention_varlen(*shards, plan, causal=causal, window=window,
                                                strategy=strategy, return_lse=True,
                                                prefix_len=prefix_arg, **kwargs)
        index, _ = plan.positions(rank)
        pad = index < 0
        assert (out[pad] == 0).all(), "padding rows"
        out.backward(plan.shard(dout, rank).to(dtype))
        what = f"W={world} case {n} {plan.describe()}"
        expected = expected_of(ref_out, ref_lse, ref_grads, ref_dsinks)
        low = None
        if dtype != torch.float32:  # torch's own error in the low dtype sets the bounds
            low = expected_of(*_reference(q, k, v, dout, lengths, causal, window, kwargs,
                                          prefixes, compute_dtype=dtype))
        got = expected_of(plan.unshard(out.detach()), plan.unshard(lse.detach().T.contiguous()).T,
                          [plan.unshard(s.grad) for s in shards])
        if ref_dsinks is not None:
            got["dsinks"] = kwargs["sinks"].grad.clone()
            dist.all_reduce(got["dsinks"])
        tol = tolerance(expected, low, grad_factor=5.0)
        for name, want in expected.items():
            tol.check(name, got[name], want, what)
    assert world < 3 or subsets > 0, "the mix must exercise the subset exchange"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_attention_matches_reference(world):
    run_ranks(world, _plan_cases)


def _empty_rank(rank, world):
    torch.manual_seed(0)
    x = torch.randn(40, 2, 16)
    plan = cpattn.shard_documents([0, 40], split="none")  # one document: rank 1 holds nothing
    q = plan.shard(x, rank).requires_grad_()
    out = cpattn.ring_attention_varlen(q, q, q, plan, causal=True)
    assert out.shape == (plan.tokens[rank], 2, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape
    torch.testing.assert_close(plan.unshard(out.detach()),
                               cpattn.attention_varlen(x, x, x, [0, 40], causal=True))


def test_rank_without_tokens():
    run_ranks(2, _empty_rank)


def _disagreement(rank, world):
    plan = cpattn.shard_documents([0, 30, 38 + 4 * rank], split="balanced")  # ranks differ
    x = torch.randn(plan.tokens[rank], 2, 16)
    with pytest.raises(ValueError, match="ranks disagree"):
        cpattn.ring_attention_varlen(x, x, x, plan, timeout=20)
    plan = cpattn.shard_documents([0, 30, 38], split="balanced")
    bad = torch.randn(plan.tokens[rank] + 1, 2, 16)  # one token too many
    with pytest.raises(ValueError, match="tokens of the plan"):
        cpattn.ring_attention_varlen(bad, bad, bad, plan, timeout=20)
    other = cpattn.shard_documents([0, 30, 38], world_size=3, split="balanced")
    with pytest.raises(ValueError, match="plan for 3 ranks"):
        cpattn.ring_attention_varlen(bad, bad, bad, other, timeout=20)


def test_bad_input_raises_on_every_rank():
    run_ranks(2, _disagreement)


def _compiled(rank, world):
    plan = cpattn.shard_documents(_cu(MIX), split="balanced")
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(MIX), 4, 16) for _ in range(3))
    shards = [plan.shard(t, rank).requires_grad_() for t in (q, k, v)]

    def f(q, k, v):
        return cpattn.ring_attention_varlen(q, k, v, plan, causal=True)

    f(*shards).sum().backward()
    eager = [s.grad.clone() for s in shards]
    for s in shards:
        s.grad = None
    torch.compile(f, fullgraph=True)(*shards).sum().backward()
    for s, g in zip(shards, eager):
        torch.testing.assert_close(s.grad, g)
    dist.barrier()


def test_compiled_fullgraph_with_subset_splits():
    run_ranks(3, _compiled)


@pytest.mark.parametrize("world,seed", list(itertools.product([2, 3, 4], range(4))))
def test_plan_properties(world, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.exp(torch.randn(40, generator=gen) * 1.2 + 5).clamp(1,
                                                                                         2000)]
    cu = _cu(lengths)
    plan = cpattn.shard_documents(cu, world_size=world, split="balanced")
    every = cpattn.shard_documents(cu, world_size=world, split="all")
    none = cpattn.shard_documents(cu, world_size=world, split="none")
    assert plan.balance <= 1.05, plan.describe()
    assert plan.sent_tokens() <= every.sent_tokens() and none.sent_tokens() == 0
    # Every packed token is held by exactly one rank, at its position within its document.
    held = torch.cat([plan.positions(r)[0] for r in range(world)])
    assert torch.equal(held[held >= 0].sort().values, torch.arange(cu[-1]))
    assert [plan.positions(r)[0].numel() for r in range(world)] == list(plan.tokens)
    # The work per rank is the visible pairs of its tokens, counted by brute force.
    for r in range(world):
        index, pos = plan.positions(r)
        doc = torch.searchsorted(torch.tensor(cu[1:]), index[index >= 0], right=True)
        pairs = sum(int(visible_pairs(pos[index >= 0][doc == d], lengths[d], True, (-1, -1),
                                      0).sum()) for d in doc.unique().tolist())
        brute = sum(int(((torch.arange(lengths[d]) <= p)).sum()) for p, d in
                    zip(pos[index >= 0].tolist(), doc.tolist()))
        assert plan.work[r] == pairs == brute
    # Deterministic: the same plan again, also after other plans were made.
    cpattn.shard_documents(cu[:-1], world_size=world, split="balanced")
    again = cpattn.sharding.documents._plan.__wrapped__(
        plan.lengths, world, "zigzag", True, (-1, -1), plan.prefix, "balanced", 1.05, None)
    assert again == plan and again.signature == plan.signature
