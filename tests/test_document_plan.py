"""Document-aware sharding (issue 27): cpattn.shard_documents plans and ring_attention_varlen
over a DocumentPlan, on real gloo ranks, against a float64 reference per document: out, LSE,
dq / dk / dv and the sinks' gradient (summed over the ranks), padding rows exactly out 0 and
LSE -inf (or the sink), with the op layer's poison on (unwritten outputs are NaN). Mixes:
log-normal lengths, short documents only, one long among many short, a single document (equal
to the per-document sharding of its cu_seqlens), ranks left without whole documents or without
any token, empty documents, a few thousand tiny ones. Also: the plan's properties (pure Python),
its determinism across ranks, errors raised on every rank, torch.compile(fullgraph=True), and a
negative control proving the comparison can fail."""

import dataclasses
import itertools
import random
import re
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn import plan as P

from distributed import run_ranks
from failure_cases import raises_same_everywhere
from reference import varlen_reference
from tolerances import expected_of, tolerance

HEAD_DIM = 16


# ---------------------------------------------------------------------------------------------
# Document mixes (lengths, seeded)


def lognormal(seed: int, n: int = 8, cap: int = 90) -> list:
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(n).log_normal_(2.3, 1.0, generator=gen)
    return [int(min(cap, max(1, round(float(v))))) for v in x]


def short_only(seed: int, n: int = 12) -> list:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 7, (n,), generator=gen).tolist()


def one_long(seed: int, long: int = 70, n: int = 10) -> list:
    gen = torch.Generator().manual_seed(seed)
    short = torch.randint(1, 6, (n,), generator=gen).tolist()
    return short[:3] + [long] + short[3:]


MIXES = {
    "lognormal": lambda s, w: lognormal(s),
    "short": lambda s, w: short_only(s),
    "one_long": lambda s, w: one_long(s),
    "single": lambda s, w: [37],
    # fewer long documents than ranks: the other ranks only hold short whole ones (or nothing)
    "fewer_long": lambda s, w: [45, 3],
    "one_token": lambda s, w: [1],
    "two_docs": lambda s, w: [5, 9],
    "empties": lambda s, w: [0, 5, 0, 0, 30, 0, 3, 1, 0],
}


@dataclass(frozen=True)
class Case:
    mix: str
    dtype: torch.dtype = torch.float32
    heads: tuple = (4, 2)
    causal: bool = True
    window: tuple = (-1, -1)
    options: dict = field(default_factory=dict)  # sinks / alibi_slopes: True = drawn per head
    strategy: str = "ring"
    split: str = "balanced"
    layout: str = "zigzag"
    by_group: bool = False  # shard_documents(group=...) instead of world_size=
    split_above: object = None

    def name(self, world: int) -> str:
        return (f"W={world} {self.mix} {str(self.dtype)[6:]} {self.heads} causal={self.causal} "
                f"{self.window} {sorted(self.options)} {self.strategy} split={self.split} "
                f"{self.layout}")


SINKS, ALIBI = {"sinks": True}, {"alibi_slopes": True}
CASES = [
    Case("lognormal"),
    Case("lognormal", torch.bfloat16, (4, 1), True, (7, 0), SINKS, "allgather", "auto"),
    Case("short", heads=(4, 4), causal=False, options={"softcap": 3.0, **ALIBI},
         strategy="auto"),
    Case("one_long", causal=False, window=(4, 6), options={"softmax_scale": 0.3, **SINKS},
         split="all", layout="striped"),
    Case("one_long", heads=(4, 1), options={"prefix_len": 5}, strategy="allgather",
         layout="contiguous", by_group=True),
    Case("empties", options={"prefix_len": "per_document", **ALIBI, **SINKS}),
    Case("single", options={"softcap": 4.0}),
    Case("single", torch.bfloat16, (4, 2), False, (-1, -1), {}, "allgather", "all"),
    Case("fewer_long", options=SINKS, strategy="auto"),
    Case("one_token", split="all", options=SINKS),  # the other ranks: padding only
    Case("one_token", split="none", strategy="allgather", options=SINKS),
    Case("two_docs", causal=False, window=(4, 6), split="none", options=ALIBI),
    Case("lognormal", torch.bfloat16, (4, 2), False, (-1, -1), {"prefix_len": "per_document"},
         "ring", "none", by_group=True),
    Case("lognormal", causal=True, window=(7, 0), options={"prefix_len": 3, "softcap": 2.0},
         strategy="auto", split="auto"),
    Case("one_long", options={"prefix_len": "per_document"}, split="all", strategy="auto",
         split_above=20),
]


def _inputs(case: Case, lengths: list, seed: int):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    h, hkv = case.heads
    q = torch.randn(total, h, HEAD_DIM, generator=gen)
    k, v = (torch.randn(total, hkv, HEAD_DIM, generator=gen) for _ in range(2))
    dout = torch.randn(total, h, HEAD_DIM, generator=gen)
    kwargs = {}
    for key, value in case.options.items():
        if key == "sinks":
            kwargs[key] = torch.randn(h, generator=gen)
        elif key == "alibi_slopes":
            kwargs[key] = torch.rand(h, generator=gen) * 0.4 + 0.01
        elif key == "prefix_len" and value == "per_document":  # none, part or all of a doc
            kwargs[key] = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=gen))
                                        for n in lengths], dtype=torch.int64)
        else:
            kwargs[key] = value
    return [t.to(case.dtype) for t in (q, k, v, dout)], kwargs


def doc_reference(q, k, v, dout, lengths, causal, window, kwargs, compute_dtype=torch.float64):
    """float64 (or compute_dtype) attention of each document on its own (positions within the
    document), every option; returns out (T, H, Dv), lse (H, T), [dq, dk, dv], dsinks (None
    without sinks)."""
    return varlen_reference(q, k, v, dout, lengths, causal, window, sinks=kwargs.get("sinks"),
                            compute_dtype=compute_dtype,
                            softcap=kwargs.get("softcap", 0.0),
                            prefix_len=kwargs.get("prefix_len", 0),
                            scale=kwargs.get("softmax_scale"),
                            alibi_slopes=kwargs.get("alibi_slopes"))


def make_plan(case: Case, cu, world: int, kwargs: dict):
    where = {"group": None} if case.by_group else {"world_size": world}
    extra = {} if case.split_above is None else {"split_above": case.split_above}
    return cpattn.shard_documents(cu, **where, layout=case.layout, causal=case.causal,
                                  window=case.window, prefix_len=kwargs.get("prefix_len", 0),
                                  split=case.split, **extra)


def check_case(rank: int, world: int, case: Case, seed: int, tamper=None) -> str:
    """Runs `case` on this rank and checks the unsharded results against the reference.
    tamper(plan): the plan the attention is given instead of the one the shards come from."""
    lengths = MIXES[case.mix](seed, world)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    (q, k, v, dout), kwargs = _inputs(case, lengths, seed)
    plan = make_plan(case, cu, world, kwargs)
    what = f"{case.name(world)} docs={lengths if len(lengths) < 20 else len(lengths)} " \
           f"[{plan.describe()}]"
    index, within = plan.positions(rank)
    assert index.numel() == plan.tokens[rank] == within.numel(), what
    shards = [plan.shard(t, rank).requires_grad_() for t in (q, k, v)]
    if "sinks" in kwargs:
        kwargs["sinks"] = kwargs["sinks"].clone().requires_grad_()
    out, lse = cpattn.ring_attention_varlen(
        *shards, plan if tamper is None else tamper(plan), causal=case.causal,
        window=case.window, layout=case.layout, strategy=case.strategy, return_lse=True,
        timeout=60, **kwargs)
    assert out.shape == (plan.tokens[rank], case.heads[0], HEAD_DIM), what
    assert lse.shape == (case.heads[0], plan.tokens[rank]) and lse.dtype == torch.float32, what
    assert out.dtype == case.dtype, what
    assert not out.isnan().any() and not lse.isnan().any(), f"unwritten (NaN) output: {what}"
    pad = index < 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), f"padding rows' out: {what}"
    pad_lse = lse[:, pad]
    if "sinks" in kwargs:
        sink = kwargs["sinks"].detach()[:, None].expand_as(pad_lse)
        assert torch.equal(pad_lse, sink), f"padding rows' lse: {what}"
    else:
        assert bool((pad_lse == float("-inf")).all()), f"padding rows' lse: {what}"
    out.backward(plan.shard(dout, rank))
    un = lambda t, d=0: plan.unshard(t, dim=d)  # noqa: E731
    expected = expected_of(*doc_reference(q, k, v, dout, lengths, case.causal, case.window,
                                          kwargs))
    low = None
    if case.dtype != torch.float32:  # torch's own error in the low dtype sets the bounds
        low = expected_of(*doc_reference(q, k, v, dout, lengths, case.causal, case.window,
                                         kwargs, compute_dtype=case.dtype))
    got = expected_of(un(out.detach()), un(lse.detach(), 1), [un(s.grad) for s in shards])
    if "sinks" in kwargs:
        got["dsinks"] = kwargs["sinks"].grad.clone()
        dist.all_reduce(got["dsinks"])  # the trainer's parameter-gradient reduction
    tol = tolerance(expected, low)
    for name, want in expected.items():
        tol.check(name, got[name], want, what)
    if case.mix == "single" and world > 1:
        # one document split: the per-document sharding of its cu_seqlens, value for value
        assert plan.split == (0,) and all(w == () for w in plan.whole), what
        shards_cu = [cpattn.shard_varlen(t, cu, layout=case.layout) for t in (q, k, v)]
        assert all(torch.equal(a, b) for a, b in zip(shards, shards_cu)), what
        out_cu = cpattn.ring_attention_varlen(*shards_cu, cu, causal=case.causal,
                                              window=case.window, layout=case.layout,
                                              strategy=case.strategy, **kwargs)
        assert torch.equal(out.detach(), out_cu.detach()), f"plan vs cu_seqlens {what}"
    return what


def _cases(rank: int, world: int) -> list:
    P.set_machine(P.PRESETS["cpu-gloo"])  # strategy / split "auto" without calibrating
    done = []
    for n, case in enumerate(CASES):
        done.append(check_case(rank, world, case, 1000 * world + n))
    return done


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_attention_matches_per_document_reference(world):
    described = run_ranks(world, _cases)[0]
    assert len(described) == len(CASES)
    if world > 1:  # the mixes reach every part of the plan
        assert any(re.search(r"\[0 of ", d) for d in described)  # nothing split
        assert any(re.search(r"\[[1-9][0-9]* of ", d) for d in described)  # some split


def _special_cases(rank: int, world: int) -> None:
    P.set_machine(P.PRESETS["cpu-gloo"])
    # A rank without any token (split="none": 2 documents, 3 ranks; one 1-token document).
    for mix in ("two_docs", "one_token"):
        lengths = MIXES[mix](0, world)
        p = make_plan(Case(mix, split="none"), torch.tensor([0, *lengths]).cumsum(0), world, {})
        assert p.sent_tokens() == 0 and 0 in p.tokens, p
    # One 1-token document split over every rank: the others hold padding only.
    p = make_plan(Case("one_token", split="all"), torch.tensor([0, 1]), world, {})
    assert p.split == (0,) and p.tokens == (2, 2, 2), p
    # A few thousand tiny documents (and one long one, split by split_above), two heads.
    gen = torch.Generator().manual_seed(7)
    tiny = torch.randint(1, 4, (2500,), generator=gen).tolist()
    MIXES["tiny"] = lambda s, w: tiny[:1200] + [60] + tiny[1200:]
    for case in (Case("tiny", heads=(2, 1), options=SINKS, split_above=50),
                 Case("tiny", heads=(2, 1), causal=False, window=(4, 6), split="all",
                      strategy="allgather")):
        what = check_case(rank, world, case, 5)
        assert re.search(r"\[[1-9][0-9]* of 2501 documents split", what), what


def test_plan_ranks_without_tokens_and_thousands_of_documents():
    run_ranks(3, _special_cases)


# ---------------------------------------------------------------------------------------------
# Negative control: the comparison above can fail


def _negative_control(rank: int, world: int) -> None:
    case = Case("short", split="none")
    lengths = MIXES["short"](11, world)
    plan = make_plan(case, torch.tensor([0, *lengths]).cumsum(0), world, {})
    assert any(plan.whole_lengths(r) != plan.whole_lengths(r)[::-1] for r in range(world)), plan
    check_case(rank, world, case, 11)  # the untampered plan passes

    def shuffled(p):  # each rank's whole documents in another order; shard not updated
        return dataclasses.replace(p, whole=tuple(w[::-1] for w in p.whole))

    with pytest.raises(AssertionError, match="out W=2"):
        check_case(rank, world, case, 11, tamper=shuffled)


def test_negative_control_shuffled_assignment_fails():
    run_ranks(2, _negative_control)


# ---------------------------------------------------------------------------------------------
# Errors on every rank, determinism across ranks


def _errors(rank: int, world: int) -> None:
    P.set_machine(P.PRESETS["cpu-gloo"])
    x = torch.randn(40, 2, HEAD_DIM)
    # ranks disagree on the documents
    cu = torch.tensor([0, 12, 30 + 2 * rank])
    plan = cpattn.shard_documents(cu, world_size=world, split="balanced")
    xs = plan.shard(x, rank)
    with pytest.raises(ValueError, match="ranks disagree"):
        cpattn.ring_attention_varlen(xs, xs, xs, plan, causal=True, timeout=20)
    cu = torch.tensor([0, 12, 30])
    plan = cpattn.shard_documents(cu, world_size=world, split="balanced")
    xs = plan.shard(x, rank)
    # a wrong local length (on rank 0 only, then on every rank)
    bad = xs[:-1] if rank == 0 else xs
    raises_same_everywhere(r"invalid on rank\(s\) 0 .*tokens of the plan",
                           cpattn.ring_attention_varlen, bad, bad, bad, plan, causal=True,
                           timeout=20)
    with pytest.raises(ValueError, match="tokens of the plan"):
        cpattn.ring_attention_varlen(xs[1:], xs[1:], xs[1:], plan, causal=True, timeout=20)
    # the plan's mask, layout, world are the attention's
    for kwargs, match in [({"causal": True, "layout": "striped"}, "layout"),
                          ({"causal": True, "strategy": "ulysses"}, "strategy"),
                          ({"causal": True, "return_max_logits": True}, "return_max_logits"),
                          ({"causal": True, "prefix_len": torch.tensor([1.0, 2.0])}, "prefix_len"),
                          ({"causal": True, "prefix_len": torch.tensor([1, 2, 3])}, "prefix_len"),
                          ({"causal": True, "prefix_len": torch.tensor([1, 19])}, "prefix_len")]:
        with pytest.raises(ValueError, match=match):
            cpattn.ring_attention_varlen(xs, xs, xs, plan, timeout=20, **kwargs)
    windowed = cpattn.shard_documents(cu, world_size=world, causal=False, window=(4, 6),
                                      split="balanced")
    xw = windowed.shard(x, rank)
    # another mask than the plan's runs (exactly: the plan only placed the tokens)
    cpattn.ring_attention_varlen(xw, xw, xw, windowed, causal=True, timeout=20)
    cpattn.ring_attention_varlen(xw, xw, xw, windowed, causal=False, window=(4, 6), timeout=20)
    other = cpattn.shard_documents(cu, world_size=world + 1, split="balanced")
    xo = other.shard(x, rank)
    with pytest.raises(ValueError, match="plan for 3 ranks"):
        cpattn.ring_attention_varlen(xo, xo, xo, other, causal=True, timeout=20)
    with pytest.raises(ValueError, match="ranks disagree"):  # a plan of other arguments
        p = cpattn.shard_documents(cu, world_size=world, split="all" if rank else "none")
        xp = p.shard(x, rank)
        cpattn.ring_attention_varlen(xp, xp, xp, p, causal=True, timeout=20)
    # a bad unshard argument on one rank raises on every rank (no rank left waiting)
    with pytest.raises(ValueError, match=r"invalid on rank\(s\) 0"):
        plan.unshard(None if rank == 0 else xs)
    with pytest.raises(ValueError, match=r"invalid on rank\(s\) 1"):
        plan.unshard(xs, dim=3 if rank == 1 else 0)
    with pytest.raises(ValueError, match="tokens of the plan"):
        plan.unshard(xs[1:])
    # the group still works
    out = cpattn.ring_attention_varlen(xs, xs, xs, plan, causal=True, timeout=20)
    assert out.shape == xs.shape and not out.isnan().any()
    # bad plan arguments (no ranks involved)
    for kwargs, match in [({"split": "some"}, "split"), ({"tolerance": 0.9}, "tolerance"),
                          ({"prefix_len": [1, 2, 3]}, "prefix_len"),
                          ({"layout": "spiral"}, "layout"), ({"causal": 1}, "causal"),
                          ({"split": "none", "heads": 4}, "heads")]:
        with pytest.raises(ValueError, match=match):
            cpattn.shard_documents(cu, world_size=world, **kwargs)


def _determinism(rank: int, world: int) -> None:
    P.set_machine(P.PRESETS["cpu-gloo"])
    args = [dict(cu_seqlens=torch.tensor([0, *lengths]).cumsum(0), world_size=world,
                 causal=causal, window=window, split=split, layout=layout)
            for lengths, (causal, window), split, layout in [
                (lognormal(1, 30), (True, (-1, -1)), "balanced", "zigzag"),
                (one_long(2, 120, 40), (True, (7, 0)), "auto", "zigzag"),
                (short_only(3, 50), (False, (4, 6)), "all", "striped"),
                (lognormal(4, 20), (False, (-1, -1)), "none", "contiguous"),
                (lognormal(5, 25), (True, (-1, -1)), "auto", "zigzag")]]
    order = list(range(len(args)))
    random.Random(rank).shuffle(order)  # another call order on every rank
    plans = {}
    for i in order:
        cpattn.shard_documents(torch.tensor([0, 3, 90]), world_size=world, split="balanced")
        plans[i] = cpattn.shard_documents(**args[i])
        again = cpattn.shard_documents(**{**args[i], "cu_seqlens": args[i]["cu_seqlens"].tolist()})
        assert again == plans[i] and again.signature == plans[i].signature
    mine = [plans[i] for i in range(len(args))]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    for other in everyone:
        assert other == mine
        assert [p.signature for p in other] == [p.signature for p in mine]
    assert len({p.signature for p in mine}) == len(mine)  # other arguments, other plans
    # the signature tells apart plans that differ only in the mask or the world
    cu = torch.tensor([0, 10, 30])
    base = cpattn.shard_documents(cu, world_size=world, split="none")
    for kw in ({"causal": False}, {"window": (3, 0)}, {"world_size": world + 1}):
        assert cpattn.shard_documents(cu, **{"world_size": world, "split": "none", **kw}
                                      ).signature != base.signature
    hash(base)  # frozen and hashable


def _errors_and_determinism(rank: int, world: int) -> None:
    _errors(rank, world)
    _determinism(rank, world)


def test_errors_on_every_rank_and_determinism():
    run_ranks(2, _errors_and_determinism)


# ---------------------------------------------------------------------------------------------
# Properties of the plan (pure Python)


def _random_mixes(count: int):
    rng = random.Random(27)
    for n in range(count):
        kind = n % 4
        if kind == 0:
            lengths = lognormal(n, rng.randint(3, 30), cap=300)
        elif kind == 1:
            lengths = short_only(n, rng.randint(5, 60))
        elif kind == 2:
            lengths = one_long(n, rng.randint(50, 200), rng.randint(3, 30))
        else:
            lengths = [rng.choice([0, 1, 2, 5, 17, 40, 90]) for _ in range(rng.randint(1, 12))]
            if sum(lengths) == 0:
                lengths.append(3)
        mask = [(True, (-1, -1)), (True, (7, 0)), (False, (-1, -1)), (False, (4, 6))][n % 4]
        yield lengths, mask, rng.choice([0, 0, 3])


def test_balanced_plans_balance_within_tolerance():
    within = fallback = 0
    for lengths, (causal, window), prefix in _random_mixes(40):
        cu = torch.tensor([0, *lengths]).cumsum(0)
        for world, layout in ((2, "zigzag"), (3, "zigzag"), (4, "zigzag"), (2, "contiguous")):
            for tol in (1.05, 1.2):
                plans = {split: cpattn.shard_documents(
                    cu, world_size=world, layout=layout, causal=causal, window=window,
                    prefix_len=prefix, split=split, tolerance=tol)
                    for split in ("balanced", "none", "all")}
                p = plans["balanced"]
                what = (lengths, world, layout, causal, window, tol, p.describe())
                if p.balance <= tol:
                    within += 1
                else:  # forced: no number of splits reaches tol; never worse than either end
                    fallback += 1
                    assert p.balance <= min(plans["none"].balance, plans["all"].balance), what
                    assert p.sent_tokens() <= plans["all"].sent_tokens(), what
                # splitting is never needed when the whole documents alone balance
                if plans["none"].balance <= tol:
                    assert p == plans["none"], what
    assert within > 100 and fallback > 5, (within, fallback)  # both branches are exercised


def brute_force_work(lengths, index, causal, window, prefix):
    """Visible query-key pairs of the tokens `index` (packed; -1 padding), one by one."""
    starts = list(itertools.accumulate([0, *lengths]))
    left, right = window
    work = 0
    for t in index.tolist():
        if t < 0:
            continue
        d = max(j for j in range(len(lengths)) if starts[j] <= t and lengths[j] > 0)
        i = t - starts[d]
        for j in range(lengths[d]):
            vis = (not causal or j <= i) and (left < 0 or j >= i - left) and \
                (right < 0 or j <= i + right)
            work += vis or j < prefix[d]
    return work


def test_plan_properties():
    for n, (lengths, (causal, window), prefix) in enumerate(_random_mixes(24)):
        lengths = [min(x, 40) for x in lengths][:14]  # tiny, for the brute force
        if sum(lengths) == 0:
            lengths = [3]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        total = sum(lengths)
        prefixes = torch.tensor([min(prefix + d % 3, x) for d, x in enumerate(lengths)])
        for world, layout in ((1, "zigzag"), (2, "zigzag"), (3, "striped"), (4, "contiguous"),
                              (4, "zigzag")):
            plans = {}
            for split in ("balanced", "all", "none", "auto"):
                extra = {"split_above": 30} if n % 5 == 0 and split != "none" else {}
                p = plans[split] = cpattn.shard_documents(
                    cu, world_size=world, layout=layout, causal=causal, window=window,
                    prefix_len=prefixes if n % 2 else prefixes.tolist(), split=split, **extra)
                what = (lengths, world, layout, split, causal, window, p.describe())
                seen = []
                for r in range(world):
                    index, within = p.positions(r)
                    assert index.numel() == p.tokens[r] == within.numel(), what
                    assert torch.equal(index < 0, within < 0), what
                    seen.append(index[index >= 0])
                    doc_start = torch.tensor(list(itertools.accumulate([0, *lengths])))
                    real = index >= 0
                    docs = torch.searchsorted(doc_start, index[real], right=True) - 1
                    assert torch.equal(within[real], index[real] - doc_start[docs]), what
                    assert p.work[r] == brute_force_work(lengths, index, causal, window,
                                                         p.prefix), (what, r)
                    lc = p.local_cu_seqlens(r)
                    assert lc[0] == p.split_tokens + p.subset_tokens[r], what
                    assert lc[-1] == p.tokens[r], what
                    assert lc.diff().tolist() == list(p.whole_lengths(r)), what
                    x = torch.arange(total, dtype=torch.float64)[:, None] + 1
                    sh = p.shard(x, r)[:, 0]
                    assert torch.equal(sh, torch.where(index >= 0, index + 1.0, 0.0)), what
                allseen = torch.cat(seen).sort().values
                assert torch.equal(allseen, torch.arange(total)), f"each token once: {what}"
                assert sorted(p.split + sum(p.whole, ())) == [d for d, x in enumerate(lengths)
                                                               if x > 0], what
                assert p.prefix == tuple(min(int(a), b) for a, b in zip(prefixes, lengths))
                if extra and world > 1 and split != "none":
                    assert all(d in p.split for d, x in enumerate(lengths) if x > 30), what
            assert plans["none"].sent_tokens() == 0 and plans["none"].split == ()
            assert plans["balanced"].sent_tokens() <= plans["all"].sent_tokens()
            assert plans["auto"] in (plans["balanced"], plans["all"], plans["none"])
            if world == 1:
                assert all(p.split == () and p.sent_tokens() == 0 for p in plans.values())
            elif not extra:  # split="all" is the per-document sharding of the cu_seqlens
                for r in range(world):
                    i_all, w_all = plans["all"].positions(r)
                    i_cu, w_cu = cpattn.positions_varlen(cu, layout=layout, rank=r,
                                                         world_size=world)
                    assert torch.equal(i_all, i_cu) and torch.equal(w_all, w_cu), what


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)


def _compiled(rank: int, world: int) -> None:
    from torch._dynamo.utils import counters

    lengths = [30, 3, 5, 2, 7, 1]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    plan = cpattn.shard_documents(cu, world_size=world, causal=True, split="balanced")
    assert plan.split and any(plan.whole), plan  # both parts: ring and local documents
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(sum(lengths), h, HEAD_DIM, generator=gen) for h in (4, 2, 2, 4)]
    sinks = torch.randn(4, generator=gen)

    def fn(q, k, v, sinks):
        return cpattn.ring_attention_varlen(q, k, v, plan, causal=True, sinks=sinks)

    counters.clear()
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = [plan.shard(t, rank).requires_grad_() for t in full[:3]] + \
            [sinks.clone().requires_grad_()]
        out = f(*xs)
        out.backward(plan.shard(full[3], rank))
        results.append([out.detach(), *(x.grad for x in xs)])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for name, e, c in zip(["out", "dq", "dk", "dv", "dsinks"], *results):
        assert bool(e.abs().max() > 0), f"{name} is zero: cannot fail"
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6, msg=f"compiled plan: {name}")


def test_fullgraph_compile_plan_w2():
    run_ranks(2, _compiled)
