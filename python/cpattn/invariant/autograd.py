"""Invariant mode (invariant=True): out, lse and every gradient bitwise independent of the number of
ranks, the layout and the strategy. Each rank computes exactly what one process computes for its
own query rows (out, lse, dQ) and its own keys (dK, dV), in kernel calls whose sums run in an
order fixed by global positions (csrc/ops/invariant.cpp, csrc/include/cpattn/invariant.h). The
forward gathers every rank's K and V of a head group at a time (as the all-gather strategy). The
backward streams every rank's dout, q, K and V a part at a time in global order (with every
rank's lse and dlse - rowsum(dout * out), gathered) and adds this rank's rows against each part's
keys (dQ) and each part's rows against this rank's keys (dK, dV) to fp32 running sums, so that
its memory per rank does not grow with W. Striped shards are moved to the contiguous layout
first. cpattn.attention(invariant=True) is the same computation over one
rank: the reference. docs/invariance.md."""

from itertools import accumulate
from typing import Optional

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn._autograd import once_differentiable
from cpattn._layout import LAYOUTS
from cpattn._validation import error
from cpattn.strategies.common import backward_in_passes, forward_in_passes, input_grads


def check_invariant_call(what: str, q: torch.Tensor) -> None:
    """What invariant=True needs beyond the options: CPU tensors."""
    if q.device.type != "cpu":
        raise error(what, "invariant", True, "runs on CPU tensors only in this version (on CUDA "
                    "it has not run on a GPU yet: the kernels' fixed order is checked in "
                    f"emulation only), got q on {q.device}")


def _padded(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> list:
    """The lengths of the packed documents `docs` each padded to the layout's granularity (as
    ring_attention_varlen shards them), or with docs None the sequence's: W `local` tokens."""
    granularity = 2 * world if layout_code == LAYOUTS["zigzag"] else world
    return [local * world] if docs is None else [-(-n // granularity) * granularity for n in docs]


def _positions(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> list:
    """Per rank, the global position of each of its `local` tokens (the layout's rule:
    torch.ops.cpattn.layout_positions). docs: packed documents' lengths, each padded to the
    layout's granularity and sharded on its own (ring_attention_varlen), or None: one
    sequence."""
    padded = _padded(layout_code, world, local, docs)
    return [[g + p for g, n in zip(accumulate([0, *padded]), padded) if n
             for p in torch.ops.cpattn.layout_positions(n, world, r, layout_code).tolist()]
            for r in range(world)]


_RUNS: dict = {}  # _runs' results by arguments


@torch._dynamo.assume_constant_result  # compiled: run while tracing, its result a constant
def _runs(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> tuple:
    """Per rank, (local begin, length, global begin) of each run of consecutive positions of its
    shard of `local` tokens (_positions), cut at the same local indices on every rank (zigzag's
    last rank holds two chunks that follow each other, cut like the others'; documents at their
    starts), so that the ranks' j-th runs have one length."""
    key = (layout_code, world, local, docs)
    if key not in _RUNS:
        pos = _positions(layout_code, world, local, docs)
        doc_starts = set(accumulate(n // world for n in _padded(layout_code, world, local, docs)))
        cuts = sorted({i for p in pos for i in range(1, local) if p[i] != p[i - 1] + 1}
                      | (doc_starts - {0}) | {local})
        _RUNS[key] = tuple(tuple((b, e - b, p[b]) for b, e in zip([0, *cuts], cuts) if e > b)
                           for p in pos)
    return _RUNS[key]


_RELAYOUTS: dict = {}  # _relayout_plan's results by arguments


def _relayout_plan(src_code: int, dst_code: int, world: int, rank: int, local: int,
                   docs: Optional[tuple]) -> tuple:
    """How this rank's `local` tokens in layout src go to their owners in layout dst (the same
    padded length): the order in which it sends its rows, how many go to each rank, how many
    come from each, and the local index in dst of each row received."""
    key = (src_code, dst_code, world, rank, local, docs)
    if key not in _RELAYOUTS:
        src, dst = (torch.tensor(_positions(c, world, local, docs)) for c in (src_code, dst_code))
        sender = torch.empty(world * local, dtype=torch.int64)  # by position: its rank in src,
        owner, index = torch.empty_like(sender), torch.empty_like(sender)  # its rank, index in dst
        for r in range(world):
            sender[src[r]] = r
            owner[dst[r]], index[dst[r]] = r, torch.arange(local)
        mine = src[rank]  # what this rank holds: sent grouped by owner, in its local order
        send_order = torch.argsort(owner[mine] * local + index[mine])
        arriving = sender[dst[rank]]  # received grouped by sender, in this rank's dst order
        recv_index = torch.argsort(arriving * local + torch.arange(local))
        _RELAYOUTS[key] = (send_order, torch.bincount(owner[mine], minlength=world).tolist(),
                           torch.bincount(arriving, minlength=world).tolist(), recv_index)
    return _RELAYOUTS[key]


class Relayout(torch.autograd.Function):
    """apply(t, dim, group, rank, world, src_code, dst_code, docs): this rank's tokens of t
    (along dim) in layout src -> its tokens in layout dst (one all-to-all; an exact permutation,
    so no bit changes); the backward moves the gradient back."""

    @staticmethod
    def forward(ctx, t, dim, group, rank, world, src_code, dst_code, docs):
        ctx.args = (dim, group, rank, world, dst_code, src_code, docs)
        send_order, to_each, from_each, recv_index = _relayout_plan(
            src_code, dst_code, world, rank, t.shape[dim], docs)
        rows = t.movedim(dim, 0).index_select(0, send_order)
        recv = comm.rows_all_to_all(rows, from_each, to_each, group.group_name)
        return torch.empty_like(recv).index_copy_(0, recv_index, recv).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        return Relayout.apply(grad.contiguous(), *ctx.args), *([None] * 7)


def gather_global(tensors: list, dim: int, group, rank: int, world: int, layout_code: int,
                  docs: Optional[tuple] = None) -> list:
    """Every rank's shard of each of `tensors` (its tokens along `dim`, in the layout's order;
    with docs, the packed documents' shards) in global order: each tensor's shape with W times
    the tokens along `dim`. Stored sequence-major, so that the ranks' runs of positions that
    follow each other in rank order (contiguous; zigzag's first chunks) are gathered in place,
    all in flight at once; other runs (zigzag's second chunks, in reverse rank order) through a
    buffer, one at a time (a buffer is the size of the result's run). Not compiled: traced
    collectives are waited for one by one. With one rank, the tensors themselves."""
    if world == 1:
        return list(tensors)
    in_flight = {} if torch.compiler.is_compiling() else {"async_op": True}
    outs, works, buffered = [], [], []
    for t in tensors:
        local = t.shape[dim]
        src = t.movedim(dim, 0)
        out = src.new_empty((world * local, *src.shape[1:]))
        runs = _runs(layout_code, world, local, docs)
        for j, (begin, length, _) in enumerate(runs[rank]):  # the ranks' j-th runs: equal lengths
            starts = [runs[r][j][2] for r in range(world)]
            mine = src.narrow(0, begin, length).contiguous()
            if starts == [starts[0] + r * length for r in range(world)]:
                works.append((mine, comm.all_gather_flat(out.narrow(0, starts[0], world * length),
                                                         mine, group=group, **in_flight)))
            else:
                buffered.append((out, mine, starts))
        outs.append(out.movedim(0, dim))
    for out, mine, starts in buffered:
        length = mine.shape[0]
        gathered = mine.new_empty((world * length, *mine.shape[1:]))
        comm.all_gather_flat(gathered, mine, group=group)
        for r, start in enumerate(starts):
            out.narrow(0, start, length).copy_(gathered.narrow(0, r * length, length))
        del gathered
    for _, work in works:
        if work is not None:
            work.wait()
    return outs


# Bytes (of all the tensors) per piece of stream_global: two pieces alive bound its memory (the
# caller's part and the next piece, in flight; the caller drops its part before asking for the
# next).
# Fewer, larger pieces cost less: each part's kernel calls pack this rank's rows again.
_STREAM_BYTES = 8 << 20


def stream_global(tensors: list, dim: int, group, rank: int, world: int, layout_code: int,
                  docs: Optional[tuple] = None):
    """Every rank's shards of `tensors` (their tokens along `dim`, as gather_global) in global
    order, a part at a time: yields (begin, parts), the tokens [begin, begin + n) of each. Each
    part starts a document (the sequence) or a multiple of invariant_chunk() tokens into it, so
    the kernels' fixed-order sums continue across parts; it is at most one piece of a rank's
    run plus fewer than invariant_chunk() tokens carried from the piece before. Each run is
    broadcast by its owner in pieces of about _STREAM_BYTES (one broadcast per tensor: the
    owner's are views), the next piece while the caller works on the current part. Compiled
    (traced collectives have no broadcast): one part, every token (gather_global)."""
    if torch.compiler.is_compiling():
        yield 0, gather_global(tensors, dim, group, rank, world, layout_code, docs)
        return
    align = torch.ops.cpattn.invariant_chunk()
    local = tensors[0].shape[dim]
    sources = [t.movedim(dim, 0) for t in tensors]
    runs = _runs(layout_code, world, local, docs)
    token_bytes = sum(s[0].numel() * s.element_size() for s in sources)
    step = max(align, _STREAM_BYTES // token_bytes)  # tokens per piece
    order = sorted((g + i, r, b + i, min(step, n - i)) for r in range(world)
                   for b, n, g in runs[r] for i in range(0, n, step))
    doc_starts = list(accumulate([0, *_padded(layout_code, world, local, docs)]))[:-1]

    def receive(piece):  # start the owner's broadcasts of one piece of every tensor
        _, owner, begin, n = piece
        bufs = [src.narrow(0, begin, n).contiguous() if owner == rank else
                src.new_empty((n, *src.shape[1:])) for src in sources]
        root = dist.get_global_rank(group, owner)
        return bufs, [dist.broadcast(b, root, group=group, async_op=True) for b in bufs]

    def as_parts(bufs):
        return [b.movedim(0, dim) for b in bufs]

    carry, carry_begin = None, 0
    pending = receive(order[0])
    for i, piece in enumerate(order):
        bufs, works = pending
        if i + 1 < len(order):
            pending = receive(order[i + 1])
        for w in works:
            w.wait()
        begin = piece[0]
        if carry is not None and begin in doc_starts:  # a document ends with the carried tokens
            yield carry_begin, as_parts(carry)
            carry = None
        if carry is None:
            carry, carry_begin = bufs, begin
        else:
            carry = [torch.cat([c, b]) for c, b in zip(carry, bufs)]
        doc_start = max(s for s in doc_starts if s <= carry_begin)
        end = carry_begin + len(carry[0])
        cut = doc_start + (end - doc_start) // align * align
        if cut > carry_begin:
            yield carry_begin, as_parts([c[:cut - carry_begin] for c in carry])
            carry = None if cut == end else [c[cut - carry_begin:] for c in carry]
            carry_begin = cut
    if carry is not None:
        yield carry_begin, as_parts(carry)


def _computed_once(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> bool:
    """Whether the backward can compute each block once (_backward_once): without documents,
    every rank's runs start and end at multiples of invariant_chunk() (so each chunk of rows is
    one rank's), not compiled (its point-to-point messages are not traced)."""
    if world == 1 or docs is not None or torch.compiler.is_compiling():
        return False
    align = torch.ops.cpattn.invariant_chunk()
    return all(b % align == 0 and n % align == 0 and g % align == 0
               for runs in _runs(layout_code, world, local, docs) for b, n, g in runs)


# Parts of the keys whose planes _backward_once sends and adds while it computes the next ones: a
# rank whose rows see less of one part runs ahead instead of waiting for the others. Each part in
# flight keeps its planes alive; two were no faster than one here and raised the peak.
_PARTS_IN_FLIGHT = 1


def _backward_once(sums: tuple, mine: tuple, k: torch.Tensor, v: torch.Tensor, group, rank: int,
                   world: int, layout_code: int, seqlen: int, op_kwargs: dict) -> None:
    """Adds every gradient term of this rank's rows and keys to the fp32 running sums (dq_sum,
    dk_sum, dv_sum), each block of rows against keys computed once, on the rows' rank. Every
    rank's K and V stream in global order (stream_global), in parts of invariant_chunk() keys;
    per part each rank adds its rows' dQ terms (invariant_bwd_rows, as invariant_bwd_part does)
    and computes the dK / dV terms of each of its chunks of rows that sees the part, a plane
    each; the part's owner receives the planes (one message per run of a rank's chunks, one
    message at a time, so that one is alive) and adds them in global order of the chunks: the
    order in which one process's kernel adds them. mine: this rank's dout, q, lse and shifted."""
    dq_sum, dk_sum, dv_sum = sums
    align = torch.ops.cpattn.invariant_chunk()
    local, d = k.shape[1], k.shape[3]
    runs = _runs(layout_code, world, local, None)
    # every rank's chunks of rows in global order: (global begin, rank, local chunk index)
    chunks = sorted((g + i, r, (b + i) // align) for r in range(world) for b, n, g in runs[r]
                    for i in range(0, n, align))
    in_flight: list = []  # (part, this rank's sends, or a part it owns: its planes to add)

    def settle(last: int) -> None:  # completes the sends and additions of parts up to `last`
        while in_flight and in_flight[0][0] <= last:
            _, works, additions, _ = in_flight.pop(0)
            for dk_keys, dv_keys, planes in additions:  # in global order of the chunks
                if isinstance(planes, tuple):  # another rank's: received now, one at a time
                    source, count, tag = planes
                    planes = dk_keys.new_empty((count, *dk_keys.shape[:3], d + dv_keys.shape[3]))
                    dist.recv(planes, dist.get_global_rank(group, source), group=group, tag=tag)
                for plane in planes:
                    dk_keys.add_(plane[..., :d])
                    dv_keys.add_(plane[..., d:])
                del planes
            for w in works:
                w.wait()

    step = 0
    for begin, (k_part, v_part) in stream_global([k, v], 1, group, rank, world, layout_code):
        owner, owner_begin = next((r, b + begin - g) for r in range(world)
                                  for b, n, g in runs[r] if g <= begin < g + n)
        for offset in range(0, k_part.shape[1], align):
            n, start = min(align, k_part.shape[1] - offset), begin + offset
            step += 1
            seen = torch.ops.cpattn.invariant_chunks_seen(local, start, n, world, layout_code,
                                                          seqlen, None, **op_kwargs).tolist()
            # the chunks that see the part, in global order, as runs of one rank's chunks
            segments: list = []
            for _, r, j in chunks:
                if seen[r][j]:
                    if segments and segments[-1][0] == r:
                        segments[-1][1].append(j)
                    else:
                        segments.append((r, [j]))
            own = [j for r, js in segments if r == rank for j in js]
            planes = dq_sum.new_zeros((len(own), k.shape[0], n, *k.shape[2:3], d + v.shape[3]))
            if own:
                torch.ops.cpattn.invariant_bwd_rows(
                    dq_sum, planes, *mine[:2], k_part.narrow(1, offset, n),
                    v_part.narrow(1, offset, n), *mine[2:], own, start, rank, world, layout_code,
                    seqlen, None, **op_kwargs)
            works, additions, i = [], [], 0
            keys = [s.narrow(1, owner_begin + offset, n) for s in (dk_sum, dv_sum)]
            for t, (r, js) in enumerate(segments):
                tag = step * 4096 + t  # the same on both sides: the part and the segment
                if r == rank:
                    mine_now = planes[i:i + len(js)]
                    i += len(js)
                    if owner == rank:
                        additions.append((*keys, mine_now))
                    else:
                        works.append(dist.isend(mine_now, dist.get_global_rank(group, owner),
                                                group=group, tag=tag))
                elif owner == rank:
                    additions.append((*keys, (r, len(js), tag)))
            in_flight.append((step, works, additions, planes))  # planes: alive until sent
            settle(step - _PARTS_IN_FLIGHT)
    settle(step)


def _finished(grad_sum: torch.Tensor, softmax_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """A streamed gradient's fp32 sum, scaled once and rounded to the gradient's dtype: the
    multiply in fp32 (the scale rounded to fp32 first) and round to nearest even, as the kernels
    write a whole call's gradients."""
    return grad_sum.mul_(softmax_scale).to(dtype)


class InvariantAttention(torch.autograd.Function):
    """apply(q, k, v, sinks, options, group, rank, world, layout_code, seqlen, group_size, docs):
    q (B, L, H, D), k / v (B, L, Hkv, D / Dv) this rank's shards (with one rank the whole
    sequence; q may then be shorter, bottom-right aligned), seqlen the real global length (the
    shards' tokens past it are padding), group_size the KV heads gathered at a time; docs None
    or packed documents (batch 1) as ring_attention_varlen shards them: their lengths (D,), or
    (2, D) with each one's prefix as the second row (seqlen is then unused)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group, rank, world, layout_code, seqlen,
                group_size, docs):
        lengths = None if docs is None else tuple(docs.view(-1, docs.shape[-1])[0].tolist())

        def attend(qh, kh):  # the gathered head group is freed on return, before the next one
            o = options.for_heads(qh)
            k_all, v_all = gather_global([k[:, :, kh], v[:, :, kh]], 1, group, rank, world,
                                         layout_code, lengths)
            return torch.ops.cpattn.invariant_fwd(q[:, :, qh], k_all, v_all, rank, world,
                                                  layout_code, seqlen, docs, o.sinks,
                                                  **o.op_kwargs())

        out, lse = forward_in_passes(q, k, group_size, attend)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (options, group, rank, world, layout_code, seqlen, group_size, docs, lengths)
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention(invariant=True)")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        options, group, rank, world, layout_code, seqlen, group_size, docs, lengths = ctx.args
        dout = dout.contiguous()
        dsinks = None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32,
                                                        device=sinks.device)

        def streamed(tensors):  # every rank's tokens of a head group, a part at a time
            return stream_global(tensors, 1, group, rank, world, layout_code, lengths)

        def backward_pass(qh, kh):  # (dsinks: written here, pass by pass)
            o = options.for_heads(qh)
            dout_h, q_h, out_h, lse_h, k_h, v_h = (
                t.contiguous() for t in (dout[:, :, qh], q[:, :, qh], out[:, :, qh], lse[:, qh],
                                         k[:, :, kh], v[:, :, kh]))
            dlse_h = None if dlse is None else dlse[:, qh].contiguous()
            if world == 1:  # one call: dQ, dK and dV
                dq_c, dk_c, dv_c, dsinks_c = torch.ops.cpattn.invariant_bwd(
                    dout_h, q_h, k_h, v_h, out_h, lse_h, dlse_h, o.sinks, layout_code, seqlen,
                    docs, **o.op_kwargs())
            else:  # the same sums streamed: fp32 running sums, scaled and cast once at the end
                rest = (rank, world, layout_code, seqlen, docs)
                # dlse - rowsum(dout * out) of these rows: what the kernels need of out and
                # dlse (here, and on the other ranks)
                dot = torch.ops.cpattn.row_dot(dout_h, out_h)
                shifted = -dot if dlse_h is None else dlse_h.float() - dot
                once = _computed_once(layout_code, world, q_h.shape[1], lengths)
                if not once or o.sinks is not None:  # every rank's rows' lse and shifted
                    lse_all, shifted_all = gather_global([lse_h, shifted], 2, group, rank, world,
                                                         layout_code, lengths)
                dq_sum, dk_sum, dv_sum = (torch.zeros_like(t, dtype=torch.float32)
                                          for t in (q_h, k_h, v_h))
                if once:
                    _backward_once((dq_sum, dk_sum, dv_sum), (dout_h, q_h, lse_h, shifted), k_h,
                                   v_h, group, rank, world, layout_code, seqlen, o.op_kwargs())
                else:
                    mine = (dout_h, q_h, k_h, v_h, lse_h, shifted)
                    for begin, parts in streamed([dout_h, q_h, k_h, v_h]):
                        n = parts[0].shape[1]
                        torch.ops.cpattn.invariant_bwd_part(
                            dq_sum, dk_sum, dv_sum, *mine, *parts, lse_all.narrow(2, begin, n),
                            shifted_all.narrow(2, begin, n), begin, *rest, **o.op_kwargs())
                        del parts  # freed before the stream receives the next piece
                dq_c = _finished(dq_sum, o.softmax_scale, q.dtype)
                dk_c, dv_c = _finished(dk_sum, o.softmax_scale, k.dtype), dv_sum.to(v.dtype)
                dsinks_c = None if o.sinks is None else torch.ops.cpattn.invariant_sink_bwd(
                    lse_all, shifted_all, o.sinks, *rest)
            if dsinks is not None:
                dsinks[qh].copy_(dsinks_c)
            return dq_c, dk_c, dv_c

        dq, dk, dv = backward_in_passes(q, k, v, group_size, backward_pass)
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype) if ctx.needs_input_grad[3] else None
        return input_grads(ctx, dq, dk, dv, dsinks)


def invariant_attention(q, k, v, options, group, rank: int, world: int, layout_code: int,
                        seqlen: int, group_size: int, docs: Optional[torch.Tensor]):
    """InvariantAttention of this rank's shards in any layout: striped shards (not runs of
    consecutive positions) are moved to the contiguous layout and the results back."""
    if world == 1 or layout_code != LAYOUTS["striped"]:
        return InvariantAttention.apply(q, k, v, options.sinks, options, group, rank, world,
                                        layout_code, seqlen, group_size, docs)
    lengths = None if docs is None else tuple(docs.view(-1, docs.shape[-1])[0].tolist())
    moves = (group, rank, world, LAYOUTS["striped"], LAYOUTS["contiguous"], lengths)
    back = (*moves[:3], moves[4], moves[3], lengths)
    q, k, v = (Relayout.apply(t, 1, *moves) for t in (q, k, v))
    out, lse = InvariantAttention.apply(q, k, v, options.sinks, options, group, rank, world,
                                        LAYOUTS["contiguous"], seqlen, group_size, docs)
    return Relayout.apply(out, 1, *back), Relayout.apply(lse, 2, *back)
