"""Failure semantics across real gloo ranks: the cross-rank agreement check names mismatched calls
on every rank, quickly, and an error never leaves the group unusable for the next call."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.core import agreement as _agreement
from cpattn.core.signature import signature_digest

from distributed import run_ranks
from failure_cases import TIMEOUT, qkv, raises_same_everywhere, valid_call_matches


def _one_of_each(rank: int, world: int) -> None:
    """Rank r makes a different cpattn call than its neighbours."""
    q, k, v = qkv(rank, s=4 * world, h=world * 2)
    cache = cpattn.KVCacheShard(1, 16, 2, 16)
    cache.append(k[:, :2, :2], v[:, :2, :2])
    calls = [
        lambda: cpattn.ring_attention(q, k, v, timeout=TIMEOUT),
        lambda: cpattn.ulysses_attention(q, k, v, timeout=TIMEOUT),
        lambda: cpattn.decode_attention(q[:, :1], cache, timeout=TIMEOUT),
        lambda: cpattn.ring_attention_varlen(q[0], k[0], v[0], [0, 4 * world], timeout=TIMEOUT),
    ]
    return calls


def _check_mismatched_functions(rank: int, world: int, first: int) -> None:
    calls = _one_of_each(rank, world)
    names = ["ring_attention", "ulysses_attention", "decode_attention", "ring_attention_varlen"]
    mine = (first + rank) % len(calls)
    # within a second, the same text on every rank
    text = raises_same_everywhere("ranks called different cpattn functions", calls[mine])
    for r in range(world):  # the message names every rank's function
        assert f"rank {r} called cpattn.{names[(first + r) % len(calls)]}" in text
    valid_call_matches(rank, world)


def _check_varlen_disagreements(rank: int, world: int) -> None:
    # Same number of documents and tokens, different boundaries: must not pass (issue 17).
    cases = {
        "same_total": [[0, 2, 6, 8], [0, 3, 5, 8], [0, 1, 7, 8]],
        "documents": [[0, 8], [0, 4, 8], [0, 2, 4, 8]],
        "tokens": [[0, 4, 8], [0, 4, 10], [0, 4, 12]],
    }
    gen = torch.Generator().manual_seed(rank)
    for strategy in ("ring", "allgather"):
        for per_rank in cases.values():
            cu = per_rank[rank]
            index, _ = cpattn.positions_varlen(cu)
            x = torch.randn(index.numel(), 2, 16, generator=gen)
            with pytest.raises(ValueError, match="ranks disagree on .*document_lengths"):
                cpattn.ring_attention_varlen(x, x, x, cu, strategy=strategy, timeout=TIMEOUT)
        with pytest.raises(ValueError, match="ranks disagree on .*cu_seqlens"):
            cpattn.unshard_varlen(torch.randn(4, 2), [[0, 2, 6, 8], [0, 3, 5, 8], [0, 1, 7, 8]]
                                  [rank])
    valid_call_matches(rank, world)


def _check_field_report(rank: int, world: int) -> None:
    q, k, v = qkv(rank)
    with pytest.raises(ValueError, match=r"ranks disagree on window_left \(window_left: rank 0=-1, "
                                         r"rank 1=3\)"):
        cpattn.ring_attention(q, k, v, window=(-1 if rank == 0 else 3, -1), timeout=TIMEOUT)
    dtype = torch.bfloat16 if rank else torch.float32
    with pytest.raises(ValueError, match=r"k.dtype: rank 0=torch.float32, rank 1=torch.bfloat16"):
        cpattn.ring_attention(q.to(dtype), k.to(dtype), v.to(dtype), timeout=TIMEOUT)
    # A bad input on one rank only: every rank raises the same text, which names the rank and
    # says what is wrong there.
    raises_same_everywhere(
        r"the arguments are invalid on rank\(s\) 1 \(every rank must pass the same shapes and "
        r"options\). rank\(s\) 1: ValueError: cpattn.ring_attention: "
        r"\(q.dtype, k.dtype, v.dtype\)=", cpattn.ring_attention, q, k.to(dtype), v,
        timeout=TIMEOUT)
    # Different errors on different ranks: each one, with its ranks.
    bad = [q[..., :8], q[:, :, :1]][rank]
    text = raises_same_everywhere(r"invalid on rank\(s\) 0-1 ", cpattn.ring_attention, q, bad, v,
                                  timeout=TIMEOUT)
    assert "rank(s) 0: ValueError" in text and "rank(s) 1: ValueError" in text, text
    valid_call_matches(rank, world)
    valid_call_matches(rank, world)


def _check_modes(rank: int, world: int) -> None:
    sent = []
    gather_words = _agreement.gather_words

    def counting(mine, *args, **kwargs):
        sent.append(mine.numel())
        return gather_words(mine, *args, **kwargs)

    _agreement.gather_words = counting
    q, k, v = qkv(rank)
    try:
        assert cpattn.get_rank_check() == "auto"  # on gloo (rounds on the host): every call
        cpattn.ring_attention(q, k, v, timeout=TIMEOUT)
        cpattn.ring_attention(q, k, v, timeout=TIMEOUT)
        assert sent == [12, 12], sent  # one fixed-size header per call
        cpattn.set_rank_check("always")
        sent.clear()
        cpattn.ring_attention(q, k, v, timeout=TIMEOUT)
        assert sent == [12], sent
        cpattn.set_rank_check("once")
        sent.clear()
        for _ in range(3):  # checked already (above): trusted
            cpattn.ring_attention(q, k, v, timeout=TIMEOUT)
        for _ in range(2):  # a new signature (a scale no other check uses): checked once
            cpattn.ring_attention(q, k, v, softmax_scale=0.0625, timeout=TIMEOUT)
        assert sent == [12], sent
        cpattn.set_rank_check("never")
        sent.clear()
        cpattn.ring_attention(q, k, v, timeout=TIMEOUT)
        assert sent == []
    finally:
        _agreement.gather_words = gather_words
        cpattn.set_rank_check("auto")
    valid_call_matches(rank, world)


def test_rank_check_mode_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="set_rank_check: mode must be one of"):
        cpattn.set_rank_check("sometimes")
    monkeypatch.setattr(_agreement, "_mode", None)
    monkeypatch.setenv("CPATTN_RANK_CHECK", "once")
    assert cpattn.get_rank_check() == "once"
    monkeypatch.setenv("CPATTN_RANK_CHECK", "bogus")
    with pytest.raises(ValueError, match="CPATTN_RANK_CHECK must be one of"):
        cpattn.get_rank_check()


def test_invalid_errors_travel_bounded():
    """The failing ranks' errors survive the exchange's encoding: this rank's own error named by
    the receiver, an earlier stage's map by its ranks, each error cut to half the bound (UTF-8
    kept whole), the whole within the bound; the message groups ranks by error."""
    own = _agreement._encode_errors({_agreement._SENDER: "ValueError: k has 3 heads (é)"})
    words = _agreement._errors_words([(_agreement._INVALID, own)])
    assert len(words) == 1 + _agreement._REASON_WORDS
    assert _agreement._errors_of(words, 5) == {5: "ValueError: k has 3 heads (é)"}
    many = {r: f"ValueError: {r % 2} " + "é" * 3000 for r in range(8)}
    back = _agreement._errors_of(
        _agreement._errors_words([(_agreement._INVALID, _agreement._encode_errors(many))]), 0)
    assert list(back) == [0, 1], back  # two whole records fit the bound, cut with "..."
    for rank, error in back.items():
        assert error.endswith("...") and many[rank].startswith(error[:-3]), error[:40]
    assert _agreement._errors_of(_agreement._errors_words([("q.dims", 4)]), 0) == {}
    text = str(_agreement.InvalidOnSomeRanks("f", {3: "A", 1: "A", 2: "B", 7: "A"}))
    assert text == ("f: the arguments are invalid on rank(s) 1-3, 7 (every rank must pass the "
                    "same shapes and options). rank(s) 1, 3, 7: A; rank(s) 2: B"), text


def test_signature_digest_is_unambiguous():
    digest = signature_digest
    assert digest("f", [("a", 12), ("b", 3)]) != digest("f", [("a", 1), ("b", 23)])
    assert digest("f", [("ab", 1)]) != digest("f", [("a", 1), ("b", 1)])
    assert digest("f", [("cu", bytes([0, 2, 6, 8]))]) != digest("f", [("cu", bytes([0, 3, 5, 8]))])
    assert digest("f", [("a", 1)]) != digest("g", [("a", 1)])
    assert digest("f", [("a", 1)]) == digest("f", [("a", 1)])


# ---------------------------------------------------------------------------------------------
# Bad inputs: each raises its own clear error on every rank, and the group stays usable.


def _bad_ring_inputs(q, k, v):
    """name -> (q, k, v, options, message pattern) for ring_attention, the same on every rank."""
    r = torch.randn
    return {
        "mixed_dtypes": (q.bfloat16(), k, v, {},
                         (r"\(q.dtype, k.dtype, v.dtype\)=\(torch.bfloat16, torch.float32, "
                          r"torch.float32\): must be the same dtype \(no promotion\)")),
        "int32": (q.int(), k.int(), v.int(), {},
                  r"q.dtype=torch.int32: must be float32, bfloat16 or float16"),
        "head_dim_300": (r(1, 8, 4, 300), r(1, 8, 2, 300), r(1, 8, 2, 300), {},
                         r"head_dim=300: must be between 1 and 256"),
        "head_dim_0": (r(1, 8, 4, 0), r(1, 8, 2, 0), r(1, 8, 2, 0), {},
                       r"q.shape=\(1, 8, 4, 0\): head_dim must be >= 1"),
        "heads_not_multiple": (r(1, 8, 3, 16), k, v, {},
                               r"\(heads, kv_heads\)=\(3, 2\): heads must be a multiple"),
        "batch_0": (r(0, 8, 4, 16), r(0, 8, 2, 16), r(0, 8, 2, 16), {},
                    r"q.shape=\(0, 8, 4, 16\): batch must be >= 1"),
        "q_k_lengths": (q, k[:, :4], v[:, :4], {},
                        r"\(q length, k length\)=\(8, 4\): the q and k/v shards must have"),
        "scale_0": (q, k, v, {"softmax_scale": 0.0},
                    r"softmax_scale=0.0: must be finite and > 0 in float32"),
        "scale_nan": (q, k, v, {"softmax_scale": float("nan")},
                      r"softmax_scale=nan: must be finite and > 0 in float32"),
        "scale_str": (q, k, v, {"softmax_scale": "0.1"}, r"softmax_scale='0.1': must be a real"),
        "window_-2": (q, k, v, {"window": (-2, 0)}, r"window\[0\] \(left\)=-2: must be >= -1"),
        "window_float": (q, k, v, {"window": (2.5, 0)},
                         r"window\[0\] \(left\)=2.5: must be an int"),
        "window_triple": (q, k, v, {"window": (1, 2, 3)},
                          r"window=\(1, 2, 3\): must be a pair \(left, right\) of ints"),
        "causal_str": (q, k, v, {"causal": "yes"}, r"causal='yes': must be True or False"),
        "layout": (q, k, v, {"layout": "spiral"},
                   r"layout='spiral': must be one of 'contiguous', 'zigzag', 'striped'"),
        "strategy": (q, k, v, {"strategy": "magic"},
                     r"strategy='magic': must be one of 'ring', 'allgather'"),
        "allgather_chunk_-1": (q, k, v, {"strategy": "allgather", "allgather_chunk": -1},
                               r"allgather_chunk=-1: must be >= 1"),
        "allgather_chunk_0": (q, k, v, {"strategy": "allgather", "allgather_chunk": 0},
                              r"allgather_chunk=0: must be >= 1"),
        "timeout_-1": (q, k, v, {"timeout": -1}, r"timeout=-1: must be finite and > 0"),
        "timeout_0": (q, k, v, {"timeout": 0}, r"timeout=0: must be finite and > 0"),
        "q_3d": (q[0], k, v, {}, r"q.shape=\(8, 4, 16\): must be \(batch, seqlen, heads, "),
        "not_a_tensor": ([1.0], k, v, {}, r"q=\[1.0\]: must be a torch.Tensor"),
    }


def _check_bad_inputs(rank: int, world: int) -> None:
    q, k, v = qkv(rank, h=4)
    cases = _bad_ring_inputs(q, k, v)
    for name, (bq, bk, bv, options) in ((n, c[:4]) for n, c in cases.items()):
        pattern = cases[name][4]
        for strategy in ("ring", "allgather"):
            kw = {"strategy": strategy, "timeout": TIMEOUT, **options}
            with pytest.raises(ValueError, match="cpattn.ring_attention: " + pattern):
                cpattn.ring_attention(bq, bk, bv, **kw)
            valid_call_matches(rank, world)  # the group is usable after each error
    # The ring's local-length rule is checked in C++ before its first message.
    odd = torch.randn(1, 7, 2, 16)
    with pytest.raises(RuntimeError, match="zigzag layout holds two equal segments"):
        cpattn.ring_attention(odd, odd, odd, timeout=TIMEOUT)

    x = torch.randn(8 // world * 2, 2, 16)
    varlen = {
        "float_tensor": (torch.tensor([0.0, 4.0, 8.0]),
                         r"cu_seqlens.dtype=torch.float32: must be an integer dtype"),
        "float_list": ([0, 4.5, 8], r"cu_seqlens=\[0, 4.5, 8\]: must hold ints only"),
        "not_from_0": ([1, 4, 8], r"cu_seqlens=\[1, 4, 8\]: must be 1-D, start at 0"),
        "decreasing": ([0, 6, 4], r"cu_seqlens=\[0, 6, 4\]: must be 1-D, start at 0"),
        "one_entry": ([0], r"cu_seqlens=\[0\]: must be 1-D, start at 0, hold at least one"),
    }
    for strategy in ("ring", "allgather"):
        for cu, pattern in varlen.values():
            with pytest.raises(ValueError, match="cpattn.ring_attention_varlen: " + pattern):
                cpattn.ring_attention_varlen(x, x, x, cu, strategy=strategy, timeout=TIMEOUT)
            valid_call_matches(rank, world)
        with pytest.raises(RuntimeError, match="every rank holds"):  # wrong local length
            cpattn.ring_attention_varlen(x[:3], x[:3], x[:3], [0, 8], strategy=strategy,
                                         timeout=TIMEOUT)

    # Ulysses: its own rules (contiguous shards of equal length, heads split over the ranks).
    with pytest.raises(ValueError, match=r"cpattn.ulysses_attention: \(q length, k length\)"):
        cpattn.ulysses_attention(q, k[:, :4], v[:, :4], timeout=TIMEOUT)
    uneven = torch.randn(1, 8, world + 1, 16)
    with pytest.raises(ValueError, match=f"cpattn.ulysses_attention: heads={world + 1}: must be "
                                         "divisible by the Ulysses group size"):
        cpattn.ulysses_attention(uneven, uneven, uneven, timeout=TIMEOUT)
    with pytest.raises(ValueError, match=r"cpattn.ulysses_attention: \(q.dtype, k.dtype"):
        cpattn.ulysses_attention(q.bfloat16(), k, v, timeout=TIMEOUT)
    with pytest.raises(ValueError, match=r"cpattn.unshard: dim=4: must index one of x_local's 4"):
        cpattn.unshard(q, dim=4)
    with pytest.raises(ValueError, match=r"cpattn.unshard: layout='spiral': must be one of"):
        cpattn.unshard(q, layout="spiral")
    with pytest.raises(ValueError, match=r"cpattn.unshard_varlen: cu_seqlens=\[0, 4.5\]"):
        cpattn.unshard_varlen(q[0], [0, 4.5])
    with pytest.raises(ValueError, match=r"cpattn.decode_attention: cache=None: must be a "):
        cpattn.decode_attention(q[:, :1], None, timeout=TIMEOUT)
    with pytest.raises(ValueError, match=r"cpattn.decode_attention: q.dtype=torch.int64"):
        cpattn.decode_attention(q[:, :1].long(), cpattn.KVCacheShard(1, 8, 2, 16),
                                timeout=TIMEOUT)
    valid_call_matches(rank, world)


def _check_error_inside_the_ring(rank: int, world: int) -> None:
    """The raw ops skip the Python checks: a kernel error after the first shift was posted must
    drain the shifts, so that the next call on the group works (issue 17: it used to time out
    and abort)."""
    q, k, v = qkv(rank, h=4)
    name = dist.group.WORLD.group_name
    bad = {
        "mixed_dtypes": (q.bfloat16(), k, v, 0.25),
        "head_dim_300": (torch.randn(1, 8, 4, 300), torch.randn(1, 8, 2, 300),
                         torch.randn(1, 8, 2, 300), 0.25),
        "heads_not_multiple": (torch.randn(1, 8, 3, 16), k, v, 0.25),
        "scale_0": (q, k, v, 0.0),
    }
    for bq, bk, bv, scale in bad.values():
        with pytest.raises(RuntimeError, match="cpattn"):
            torch.ops.cpattn.ring_fwd(bq, bk, bv, name, 1, float(TIMEOUT), softmax_scale=scale,
                                      causal=True)
        valid_call_matches(rank, world)
    out, lse = torch.ops.cpattn.ring_fwd(q, k, v, name, 1, float(TIMEOUT), softmax_scale=0.25,
                                         causal=True)
    with pytest.raises(RuntimeError, match="cpattn: dout must have q's shape"):  # in backward
        torch.ops.cpattn.ring_bwd(out[..., :8].contiguous(), q, k, v, out, lse, name, 1,
                                  float(TIMEOUT), softmax_scale=0.25, causal=True)
    valid_call_matches(rank, world)


# ---------------------------------------------------------------------------------------------
# Silently wrong before: now exact or an error.


def _double_backward_cases(rank: int, world: int) -> None:
    q, k, v = (t.requires_grad_() for t in qkv(rank, h=4))
    u_groups = [dist.new_group([r]) for r in range(world)]  # hybrid: Ulysses over all, ring of 1
    calls = [  # (the call, the op whose backward refuses a second order)
        (lambda: cpattn.ring_attention(q, k, v, causal=True), "cpattn.ring_attention"),
        (lambda: cpattn.ring_attention(q, k, v, causal=True, strategy="allgather"),
         "cpattn.ring_attention(strategy='allgather')"),
        (lambda: cpattn.ring_attention_varlen(q[0], k[0], v[0], [0, 4 * world, 8 * world],
                                              causal=True), "cpattn.ring_attention"),
        (lambda: cpattn.ring_attention_varlen(q[0], k[0], v[0], [0, 4 * world, 8 * world],
                                              causal=True, strategy="allgather"),
         "cpattn.ring_attention(strategy='allgather')"),
        (lambda: cpattn.ulysses_attention(q, k, v, causal=True), "cpattn.ulysses_attention"),
        (lambda: cpattn.hybrid_attention(q, k, v, ulysses_group=dist.group.WORLD,
                                         ring_group=u_groups[rank], causal=True,
                                         layout="contiguous"), "cpattn.ring_attention"),
    ]
    for call, what in calls:
        out = call()
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        pattern = re.escape(what) + ": double backward .* is not implemented"
        with pytest.raises(RuntimeError, match=pattern):
            dq.square().sum().backward()
    # cpattn.comm's collectives are differentiable twice: loss = sum(all_gather(x)^2) on every
    # rank gives dx = 2 W x (summed over the ranks) and d(sum dx)/dx = 2 W.
    x = torch.randn(1, 3, 2, requires_grad=True)
    (dx,) = torch.autograd.grad(cpattn.comm.all_gather(x).square().sum(), x, create_graph=True)
    torch.testing.assert_close(dx, 2 * world * x)
    dx.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0 * world))
    # First-order gradients are unaffected by the guard.
    out = cpattn.ring_attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (dq_plain,) = torch.autograd.grad(cpattn.ring_attention(q, k, v, causal=True).square().sum(), q)
    assert torch.equal(dq.detach(), dq_plain)


def _unshard_keeps_the_gradient(rank: int, world: int) -> None:
    x = torch.randn(1, 4, 2, 3, requires_grad=True)
    full = cpattn.unshard(x, layout="zigzag")
    grad = torch.randn(full.shape)
    kept = grad.clone()
    full.backward(grad)
    assert torch.equal(grad, kept), "unshard's backward wrote into the incoming gradient"
    # The gradient of a shard is the sum over ranks of the gradients of its tokens.
    grads = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(grads, grad)
    expected = cpattn.shard(torch.stack(grads).sum(0), layout="zigzag")
    torch.testing.assert_close(x.grad, expected)


# ---------------------------------------------------------------------------------------------
# One spawn per world size: process start-up dominates the time of these checks.


def _all_cross_rank_checks(rank: int, world: int) -> None:
    _check_mismatched_functions(rank, world, 0)
    _check_varlen_disagreements(rank, world)
    _check_bad_inputs(rank, world)
    _check_error_inside_the_ring(rank, world)
    if world == 2:
        _check_mismatched_functions(rank, world, 2)  # decode vs varlen
        _check_field_report(rank, world)
        _check_modes(rank, world)
        _unshard_keeps_the_gradient(rank, world)
        _double_backward_cases(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_failure_semantics_on_real_ranks(world):
    """Mismatched functions raise on every rank within 1 s; every varlen disagreement raises;
    each bad input raises its own message and the next valid call works (after each one);
    kernel errors inside the C++ ring leave the group usable; the processes exit 0. At W = 2
    also: the fields named in a disagreement, the check's modes, unshard's gradient and double
    backward of every distributed function."""
    run_ranks(world, _all_cross_rank_checks)
