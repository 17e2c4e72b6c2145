"""Ring attention over a torch.distributed process group (and its all-gather variant).

Each rank passes its shard of q, k, v (in `layout` order along the sequence dim) and gets the
exact attention output of its queries over the whole sequence. K/V shards travel around the ring
while the current step computes; results are merged in float32 with their log-sum-exp. The ring
driver, the schedule and the layouts live in C++ (csrc/ops/ring.cpp, csrc/include/cpattn/).
"""

from collections.abc import Callable
from typing import Optional, Union

import torch

from cpattn import plan
from cpattn.attention import LocalDocuments
from cpattn.core.agreement import agree_on
from cpattn.core.autograd import (
    backward_in_passes,
    forward_in_passes,
    input_grads,
    needs_grad,
    once_differentiable,
    sink_grad,
)
from cpattn.core.layout import (
    DTYPE_NAMES,
    LAYOUTS,
    PackedDocuments,
    default_head_group,
    doc_args,
    padded_length,
)
from cpattn.core.options import AttentionOptions, checked_call, returned
from cpattn.core.signature import digest_ints
from cpattn.core.validation import (
    check_bool,
    check_choice,
    check_int,
    check_prefix_per_document,
    check_timeout,
    document_lengths,
    error,
    group_info,
)
from cpattn.invariant import check_invariant_call, invariant_attention
from cpattn.max_logits import document_placement, global_max_logits, sequence_placement
from cpattn.sharding.documents import DocumentPlan
from cpattn.strategies.allgather import SubsetGathered, emulate_gathered, run_gathered
from cpattn.strategies.base import Strategy


class RingAttention(torch.autograd.Function):
    """The ring (csrc/ops/ring.cpp), in one pass over every head or, with group_size < kv heads,
    one pass per head group of group_size KV heads (and their query heads): each pass holds the
    fp32 state and the ring buffers of its heads only, and writes its part of the results.
    apply(q, k, v, sinks, options, group_name, layout_code, timeout, docs, group_size): docs
    a PackedDocuments or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group_name, layout_code, timeout, docs, group_size):
        def attend(qh, kh):
            o = options.for_heads(qh)
            return torch.ops.cpattn.ring_fwd(q[:, :, qh], k[:, :, kh], v[:, :, kh], group_name,
                                             layout_code, timeout, *doc_args(docs), o.sinks,
                                             **o.op_kwargs())

        out, lse = forward_in_passes(q, k, group_size, attend)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (options, group_name, layout_code, timeout, docs, group_size)
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        options, group_name, layout_code, timeout, docs, group_size = ctx.args
        dout = dout.contiguous()
        one = group_size >= k.shape[2]

        def backward_pass(qh, kh):
            return torch.ops.cpattn.ring_bwd(
                dout if one else dout[:, :, qh].contiguous(), q[:, :, qh], k[:, :, kh],
                v[:, :, kh], out[:, :, qh], lse[:, qh], group_name, layout_code, timeout,
                *doc_args(docs), None if dlse is None else dlse[:, qh],
                **options.for_heads(qh).op_kwargs())

        dq, dk, dv = backward_in_passes(q, k, v, group_size, backward_pass)
        return input_grads(ctx, dq, dk, dv, sink_grad(ctx, 3, sinks, dout, out, lse, dlse))


class RingStrategy(Strategy):
    """The two strategies ring_attention runs (its `strategy` argument): the ring and the
    all-gather. chunk_option: the argument that sets its KV heads per pass (or per gather);
    run(...): one call of its autograd Function over this rank's (1 or B, L, H, D) shards."""

    def __init__(self, name: str, chunk_option: str, run: Callable, emulate: Callable) -> None:
        super().__init__(name, _attend, _attend_varlen, emulate=emulate)
        self.chunk_option, self.run = chunk_option, run


def _attend(cp, q, k, v, **call):
    return ring_attention(q, k, v, group=cp.group, layout=cp.layout, strategy=cp.strategy,
                          allgather_chunk=cp.allgather_chunk, ring_chunk=cp.ring_chunk, **call)


def _attend_varlen(cp, q, k, v, documents, **call):
    return ring_attention_varlen(q, k, v, documents, group=cp.group, layout=cp.layout,
                                 strategy=cp.strategy, allgather_chunk=cp.allgather_chunk,
                                 ring_chunk=cp.ring_chunk, **call)


def _run_ring(q, k, v, opts, group, rank, world, layout, timeout, docs, per_pass):
    return RingAttention.apply(q, k, v, opts.sinks, opts, group.group_name, LAYOUTS[layout],
                               timeout, docs, per_pass or k.shape[2])


def _emulate_ring(q: list, k: list, v: list, layout: str, opts: AttentionOptions, what: str):
    """The ring driver with one thread per emulated rank and an in-process mailbox (the test
    ops of libcpattn_testing, loaded by cpattn.testing.emulation)."""
    outs, lses = torch.ops.cpattn_testing.ring_fwd_emulated(q, k, v, LAYOUTS[layout],
                                                            **opts.op_kwargs())
    return list(outs), list(lses)


RING = RingStrategy("ring", "ring_chunk", _run_ring, _emulate_ring)
ALLGATHER = RingStrategy("allgather", "allgather_chunk", run_gathered, emulate_gathered)
# ring_attention's strategies by name, and the values of its `strategy` argument ("auto": the
# cost model picks one per problem)
RUNS = {s.name: s for s in (RING, ALLGATHER)}
RING_ATTENTION_STRATEGIES = (*RUNS, "auto")


def _run_of(strategy: str, allgather_chunk: Optional[int], ring_chunk: Optional[int],
            choose: Callable[[], plan.Candidate]) -> tuple[RingStrategy, Optional[int]]:
    """The strategy that runs and its KV heads per pass (or per gather; None: its default):
    `strategy`'s, or for "auto" the candidate choose() picks."""
    if strategy == "auto":
        chosen = choose()
        return RUNS[chosen.strategy], chosen.chunk or None
    given = RUNS[strategy]
    return given, {"allgather_chunk": allgather_chunk,
                   "ring_chunk": ring_chunk}[given.chunk_option]


def auto_strategy(q, k, world: int, group, opts: AttentionOptions, layout: str, docs,
                  allgather_chunk: Optional[int], ring_chunk: Optional[int], what: str
                  ) -> plan.Candidate:
    """ring_attention(strategy="auto"): the ring (in passes of ring_chunk KV heads if given; of
    fewer KV heads when memory is short) or the all-gather for this rank's shards q
    (B, S/W, H, D), k (B, S/W, Hkv, D) in `layout`. Call it only after the ranks agreed on the
    shapes, options, documents and on whether gradients are needed."""
    p = plan.Problem(
        seqlen=q.shape[1] * world, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
        batch=q.shape[0], dtype=DTYPE_NAMES[q.dtype], causal=opts.causal, window=opts.window,
        documents=None if docs is None else tuple(docs.lengths.tolist()),
        mode="train" if needs_grad(q, k) else "forward")
    chunk = allgather_chunk or default_head_group(k.shape[2], world)
    cands = [plan.Candidate(RING.name, layout, chunk=ring_chunk or 0),
             plan.Candidate(ALLGATHER.name, layout, chunk=chunk)]
    return plan.choose(p, world, cands, group, what).candidate


def context_parallel(what, q, k, v, group, layout, timeout, strategy, allgather_chunk,
                     cu_seqlens, options: Union[dict, AttentionOptions], seqlen=None,
                     ring_chunk=None, return_max_logits=False):
    """Shared by ring_attention and ring_attention_varlen (cu_seqlens given: q, k, v are 3-D):
    validation and the agreement check, then the strategy. `options`: the attention options'
    keyword arguments (prefix_len may be a tensor: a prefix per sequence or document), or the
    AttentionOptions of an inner call, checked already (the hybrid's ring). Returns
    4-D out and lse, and with return_max_logits each head's largest logit (cpattn.max_logits).
    `seqlen` (ring_attention): the real length of a sequence padded to the layout's granularity,
    handled as one document of that length."""
    group, rank, world = group_info(group)
    timeout = check_timeout(what, timeout, group)
    prefix = options.get("prefix_len", 0) if isinstance(options, dict) else options.prefix_len
    per_sequence = isinstance(prefix, torch.Tensor)

    def check():
        opts, fields = checked_call(what, q, k, v, options, layout, varlen=cu_seqlens is not None,
                                    prefix_per_row=per_sequence)
        check_choice(what, "strategy", strategy, RING_ATTENTION_STRATEGIES)
        chunk, r_chunk = (None if c is None else check_int(what, name, c, minimum=1)
                          for name, c in (("allgather_chunk", allgather_chunk),
                                          ("ring_chunk", ring_chunk)))
        docs = prefix_docs = None
        if cu_seqlens is not None:  # the exact boundaries, not a sum: other splits must not pass
            docs, tokens, raw = document_lengths(what, cu_seqlens)
            fields += [("documents", docs.numel()), ("tokens", tokens),
                       ("document_lengths", raw)]
            if per_sequence:
                prefix_docs = check_prefix_per_document(what, prefix, docs)
                fields += [("prefix_per_document", digest_ints(prefix_docs))]
        elif per_sequence:
            # A prefix per sequence of the batch: the batch runs as packed documents, one per
            # sequence (a sequence's shard is what per-document sharding gives it).
            n = q.shape[1] * world if seqlen is None else check_int(what, "seqlen", seqlen,
                                                                    minimum=1)
            docs = torch.full((q.shape[0],), n, dtype=torch.int64)
            prefix_docs = check_prefix_per_document(what, prefix, docs,
                                                    unit="sequence of the batch")
            fields += [("prefix_per_sequence", digest_ints(prefix_docs))]
        if r_chunk is not None and strategy == ALLGATHER.name:  # never ignored: saves memory
            raise error(what, "ring_chunk", r_chunk, 'sets the passes of strategy "ring" (or '
                        '"auto"); the all-gather takes allgather_chunk')
        fields += [("strategy", strategy), ("allgather_chunk", chunk), ("ring_chunk", r_chunk)]
        if seqlen is not None:
            n = check_int(what, "seqlen", seqlen, minimum=1)
            if padded_length(n, layout, world) != q.shape[1] * world:
                raise error(what, "seqlen", n, f"gives shards of "
                            f"{padded_length(n, layout, world) // world} tokens under the "
                            f"{layout} layout over {world} ranks, not {q.shape[1]}")
            if n != q.shape[1] * world and docs is None:  # padded: a document of length n
                docs = torch.tensor([n], dtype=torch.int64)
            fields += [("seqlen", n)]
        if strategy == "auto":  # the choice may only depend on what the ranks agree on
            fields += [("requires_grad", needs_grad(q, k, v))]
        if opts.invariant:
            check_invariant_call(what, q)
        max_logits = check_bool(what, "return_max_logits", return_max_logits)
        if max_logits and prefix_docs is not None:
            raise error(what, "return_max_logits", True, "is not supported with a prefix per "
                        "sequence or document (prefix_len a tensor)")
        fields += [("return_max_logits", max_logits)]
        return (opts, chunk, r_chunk, docs, prefix_docs), fields

    opts, chunk, ring_chunk, docs, prefix_docs = agree_on(what, group, timeout, check)
    max_logits = None
    if return_max_logits:  # before q, k, v are reshaped below
        placement = (document_placement(docs, layout, world) if cu_seqlens is not None else
                     sequence_placement(q.shape[1] * world if seqlen is None else seqlen,
                                        layout, world))
        max_logits = global_max_logits(q[None] if cu_seqlens is not None else q,
                                       k[None] if cu_seqlens is not None else k, group,
                                       placement, opts)
    packed = cu_seqlens is not None or prefix_docs is not None
    if cu_seqlens is not None:
        q, k, v = q[None], k[None], v[None]
    elif prefix_docs is not None:  # the batch as packed documents: (B, L, ..) -> (1, B L, ..)
        batch = q.shape[0]
        q, k, v = (t.flatten(0, 1)[None] for t in (q, k, v))
    if docs is not None:  # as the ops take them: the lengths, and the prefixes if any
        docs = PackedDocuments(docs, prefix_docs)
    if opts.invariant:  # the strategy changes no bit: one computation for all of them
        out, lse = invariant_attention(
            q, k, v, opts, group, rank, world, LAYOUTS[layout],
            q.shape[1] * world if seqlen is None else seqlen,
            chunk or ring_chunk or default_head_group(k.shape[2], world),
            docs if packed else None)
    else:
        chosen, per_pass = _run_of(strategy, chunk, ring_chunk, lambda: auto_strategy(
            q, k, world, group, opts, layout, docs, chunk, ring_chunk, what))
        out, lse = chosen.run(q, k, v, opts, group, rank, world, layout, timeout, docs,
                              per_pass)
    if cu_seqlens is None and prefix_docs is not None:  # back to (B, L, ..) and (B, H, L)
        out = out.view(batch, -1, *out.shape[2:])
        lse = lse.view(lse.shape[1], batch, -1).transpose(0, 1)
    return (out, lse) if max_logits is None else (out, lse, max_logits)


# ring_attention_varlen over a cpattn.DocumentPlan: the documents split over every rank by the
# ring (or the all-gather), those split over a subset by SubsetGathered, each rank's whole
# documents by the local varlen kernel without communication.


def _documents(plan: DocumentPlan, docs: tuple, prefix: Optional[torch.Tensor]):
    """The documents `docs` of the plan as the ops take them: their lengths, and with a prefix
    per document, the prefixes."""
    lengths = torch.tensor([plan.lengths[d] for d in docs], dtype=torch.int64)
    return PackedDocuments(lengths, None if prefix is None else prefix[list(docs)])


def _plan_attention(what, q, k, v, plan: DocumentPlan, group, layout, strategy, allgather_chunk,
                    ring_chunk, timeout, options: dict, return_max_logits: bool):
    """ring_attention_varlen(q, k, v, plan): out (T_r, H, Dv) and lse (H, T_r) of this rank's
    T_r tokens of the plan."""
    group, rank, world = group_info(group)
    timeout = check_timeout(what, timeout)
    prefix = options.get("prefix_len", 0)

    def check():
        if plan.world != world:
            raise error(what, "cu_seqlens", "<DocumentPlan>", f"is a plan for {plan.world} "
                        f"ranks; the group has {world}")
        if layout != plan.layout:
            raise error(what, "layout", layout, f"differs from the plan's {plan.layout!r}")
        opts, fields = checked_call(what, q, k, v, options, plan.layout, varlen=True,
                                    empty_tokens=True,
                                    prefix_per_row=isinstance(prefix, torch.Tensor))
        if opts.invariant:  # a plan computes documents on rank subsets: their sums W-dependent
            raise error(what, "invariant", True, "is not supported over a DocumentPlan: pass "
                        "cu_seqlens (every document sharded over every rank) for packed "
                        "documents with invariant=True")
        # Ranks hold different numbers of tokens: each checks its own against the plan.
        fields = [f for f in fields if not f[0].endswith(".tokens")]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[0] != plan.tokens[rank]:
                raise error(what, f"{name}.shape[0]", t.shape[0], f"must be rank {rank}'s "
                            f"{plan.tokens[rank]} tokens of the plan (DocumentPlan.shard)")
        check_choice(what, "strategy", strategy, RING_ATTENTION_STRATEGIES)
        if return_max_logits:
            raise error(what, "return_max_logits", True, "is not supported over a "
                        "DocumentPlan (pass cu_seqlens for per-document sharding)")
        chunk, r_chunk = (None if c is None else check_int(what, name, c, minimum=1)
                          for name, c in (("allgather_chunk", allgather_chunk),
                                          ("ring_chunk", ring_chunk)))
        if r_chunk is not None and strategy == ALLGATHER.name:
            raise error(what, "ring_chunk", r_chunk, 'sets the passes of strategy "ring" (or '
                        '"auto"); the all-gather takes allgather_chunk')
        prefixes = None if not isinstance(prefix, torch.Tensor) else \
            check_prefix_per_document(what, prefix, torch.tensor(plan.lengths, dtype=torch.int64))
        fields += [("plan", plan.signature), ("strategy", strategy), ("allgather_chunk", chunk),
                   ("ring_chunk", r_chunk),
                   ("prefix_per_document", None if prefixes is None
                    else digest_ints(prefixes.tolist()))]
        if strategy == "auto":
            fields += [("requires_grad", torch.is_grad_enabled()
                        and any(t.requires_grad for t in (q, k, v)))]
        return (opts, chunk, r_chunk, prefixes), fields

    opts, chunk, ring_chunk, prefixes = agree_on(what, group, timeout, check)
    n, m = plan.split_tokens, plan.split_tokens + plan.subset_tokens[rank]
    parts = []
    if plan.full_split:  # split over every rank: the ring or the all-gather
        docs = _documents(plan, plan.full_split, prefixes)
        qs, ks, vs = q[None, :n], k[None, :n], v[None, :n]
        chosen, per_pass = _run_of(  # "auto": the faster for these documents alone
            strategy, chunk, ring_chunk, lambda: auto_strategy(
                qs, ks, world, group, opts, plan.layout,
                docs, chunk, ring_chunk, what))
        parts.append(chosen.run(qs, ks, vs, opts, group, rank, world, plan.layout, timeout,
                                docs, per_pass))
    if len(plan.full_split) < len(plan.split):  # split over subsets: every rank takes part
        pieces = plan.subset_pieces(rank)
        docs = [_documents(plan, (d,), prefixes) for d, *_ in pieces]
        parts.append(SubsetGathered.apply(q[None, n:m], k[None, n:m], v[None, n:m], opts.sinks,
                                          opts, group, LAYOUTS[plan.layout], pieces, docs))
    if plan.whole[rank]:
        docs = _documents(plan, plan.whole[rank], prefixes)
        parts.append(LocalDocuments.apply(q[None, m:], k[None, m:], v[None, m:], opts.sinks,
                                          docs, opts))
    if not parts:  # a rank without tokens: empty results, still in the autograd graph
        # of every input (q, k, v and the sinks get their zero gradients, as on other ranks)
        zero = q.sum() * 0 + k.sum() * 0 + v.sum() * 0
        if opts.sinks is not None:
            zero = zero + opts.sinks.sum() * 0
        out = zero.to(q.dtype).expand(0, q.shape[1], v.shape[-1])
        return out, q.new_empty((q.shape[1], 0), dtype=torch.float32)
    if len(parts) == 1:
        out, lse = parts[0]
    else:
        out, lse = torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 2)
    return out[0], lse[0]


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, layout: str = "zigzag",
    strategy: str = "ring", allgather_chunk: Optional[int] = None,
    ring_chunk: Optional[int] = None, seqlen: Optional[int] = None, timeout: Optional[float] = None,
    return_lse: bool = False, return_max_logits: bool = False, **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Exact attention over a sequence sharded across the ranks of `group`.

    Args:
        q: this rank's queries (batch, seqlen / W, heads, head_dim), in `layout` order
            (see cpattn.shard / cpattn.positions).
        k, v: this rank's keys / values (batch, seqlen / W, kv_heads, head_dim); v may have its
            own head dim Dv (MLA-style, e.g. 192 / 128), out then has Dv.
        group: a torch.distributed process group (default: the world).
        layout: "contiguous", "zigzag" (balanced for causal) or "striped".
        return_lse: also return the LSE (batch, heads, seqlen / W), float32.
        strategy: "ring" (K/V shards travel while each step computes: overlaps communication,
            memory per rank 1/W) or "allgather" (all-gather K/V, `allgather_chunk` KV heads at a
            time, default Hkv / (4 W), at least 1 (a gathered head group is at most a quarter of
            the rank's own K/V); simplest, good for short sequences or few KV heads).
            "auto": the cost model (cpattn.plan) picks one of the two for this problem and
            machine, once per distinct problem, the same on every rank (logged at debug level).
        ring_chunk: KV heads per pass of the ring (default: all of them, one pass). Each pass
            runs the ring for its KV heads and their query heads only, so the ring's buffers and
            fp32 state (out, dq, the travelling dK/dV accumulators) shrink by the number of
            passes, for as many times more (smaller) messages. Strategy "ring" or "auto"; with
            "allgather" it raises (that strategy takes allgather_chunk).
        timeout: seconds to wait for a peer before raising (default $CPATTN_COMM_TIMEOUT, else the
            process group's own timeout).
        **options: the attention options (cpattn.attention: causal, softmax_scale, window,
            sinks, softcap, alibi_slopes, prefix_len), on global positions (the same values on
            every rank). A sink joins each row once, after every partial result is merged; the
            LSE returned includes it. The gradient of `sinks` on a rank is its own rows' share,
            like any parameter gradient under context parallelism: the usual gradient
            all-reduce over the group (as for the projection weights) sums it.
            prefix_len may also be an int64 tensor (batch,): one prefix per sequence of the
            batch (0 <= P_b <= seqlen); the batch then runs as packed documents, one per
            sequence (as ring_attention_varlen).
        seqlen: the global sequence length, for any length (default: W times the shard length).
            Shards of a length-S sequence from cpattn.shard are padded at the end to the
            layout's granularity (cpattn.positions); padding rows get out 0 and LSE -inf (with
            sinks: LSE = the sink) and padding keys are never attended to.
        return_max_logits: also return each head's largest logit softmax_scale * q_i . k_j
            over the visible pairs of the whole sequence ((heads,) float32, the same on every
            rank, no gradient; see cpattn.max_logits), last in the returned tuple.

    Every rank must call it with the same shapes and options; a mismatch raises on every rank
    (the agreement check, see cpattn.set_rank_check), as does a bad argument.
    CUDA tensors (bf16 / fp16) shift over cpattn's own NCCL communicator, bootstrapped through
    `group` and cached: call cpattn.destroy_communicators() before destroying the group.
    """
    out, lse, *max_logits = context_parallel(
        "cpattn.ring_attention", q, k, v, group, layout, timeout, strategy, allgather_chunk, None,
        options, seqlen, ring_chunk, return_max_logits)
    return returned(out, lse if return_lse else None, max_logits)


def ring_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, group=None,
    layout: str = "zigzag", strategy: str = "ring", allgather_chunk: Optional[int] = None,
    ring_chunk: Optional[int] = None, timeout: Optional[float] = None, return_lse: bool = False,
    return_max_logits: bool = False, **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Ring (or all-gather) attention over packed documents that never attend across each other.

    cu_seqlens: global document boundaries (int, D+1, from 0), the same on every rank. Each
    document is padded to a multiple of the layout's granularity (2W for zigzag, W otherwise)
    and sharded on its own (per-document zigzag), so documents straddle ranks.
    Or a cpattn.DocumentPlan (cpattn.shard_documents; `layout` must be the plan's):
    q, k, v are then this rank's tokens of the plan (DocumentPlan.shard), only the split
    documents communicate. Any mask is exact; the work is balanced for the plan's.
    q (T_local, H, D), k/v (T_local, Hkv, D) come from cpattn.shard_varlen; padding tokens give
    output 0 and LSE -inf. Returns out (T_local, H, D) and optionally lse (H, T_local).
    strategy, allgather_chunk, ring_chunk, **options: as ring_attention (on positions within
    the document); prefix_len: an int, the same prefix for every document, or an int64 tensor
    (D,), one prefix per document (0 <= P_d <= its length, 0: none).
    Padding rows with a sink: LSE = the sink. v may have its own head dim Dv (out then has Dv).
    return_max_logits: as ring_attention (positions within the documents).
    """
    if isinstance(cu_seqlens, DocumentPlan):
        out, lse = _plan_attention("cpattn.ring_attention_varlen", q, k, v, cu_seqlens, group,
                                  layout, strategy, allgather_chunk, ring_chunk, timeout, options,
                                  return_max_logits)
        return (out, lse) if return_lse else out
    out, lse, *max_logits = context_parallel(
        "cpattn.ring_attention_varlen", q, k, v, group, layout, timeout, strategy,
        allgather_chunk, cu_seqlens, options, ring_chunk=ring_chunk,
        return_max_logits=return_max_logits)
    return returned(out[0], lse[0] if return_lse else None, max_logits)


def destroy_communicators() -> int:
    """Destroys the NCCL communicators that ring attention on CUDA tensors created (one per
    process group and device, cached across calls); returns how many. Call it before
    dist.destroy_process_group(); the next CUDA ring call makes a new one."""
    return int(torch.ops.cpattn.destroy_communicators())
