"""Operands in global order: where each rank's tokens sit in the sequence (its runs of
consecutive positions), the striped shards moved to the contiguous layout (Relayout), and every
rank's shards gathered whole (gather_global: the forward) or streamed a part at a time
(stream_global: the backward)."""

from typing import Optional

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn.core.layout import document_shards


def doc_shards(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> list:
    """Per packed document of `docs` (padded length, start in the padded sequence, start in every
    rank's shard), as ring_attention_varlen shards them (core.layout.document_shards), or with docs
    None the sequence's: one of W `local` tokens."""
    if docs is None:
        return [(local * world, 0, 0)]
    return list(document_shards(docs, layout_code, world))


def _positions(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> list:
    """Per rank, the global position of each of its `local` tokens (the layout's rule:
    torch.ops.cpattn.layout_positions). docs: packed documents' lengths, each padded to the
    layout's granularity and sharded on its own (ring_attention_varlen), or None: one
    sequence."""
    shards = doc_shards(layout_code, world, local, docs)
    return [[g + p for n, g, _ in shards if n
             for p in torch.ops.cpattn.layout_positions(n, world, r, layout_code).tolist()]
            for r in range(world)]


_RUNS: dict = {}  # global_runs' results by arguments


@torch._dynamo.assume_constant_result  # compiled: run while tracing, its result a constant
def global_runs(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> tuple:
    """Per rank, (local begin, length, global begin) of each run of consecutive positions of its
    shard of `local` tokens (_positions), cut at the same local indices on every rank (zigzag's
    last rank holds two segments that follow each other, cut like the others'; documents at their
    starts), so that the ranks' j-th runs have one length."""
    key = (layout_code, world, local, docs)
    if key not in _RUNS:
        pos = _positions(layout_code, world, local, docs)
        doc_starts = {begin for _, _, begin in doc_shards(layout_code, world, local, docs)}
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
    follow each other in rank order (contiguous; zigzag's first segments) are gathered in place,
    all in flight at once; other runs (zigzag's second segments, in reverse rank order) through a
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
        runs = global_runs(layout_code, world, local, docs)
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


# Bytes (of all the tensors) per broadcast of stream_global: two alive bound its memory (the
# caller's part and the next broadcast, in flight; the caller drops its part before asking for
# the next).
# Fewer, larger broadcasts cost less: each part's kernel calls pack this rank's rows again.
_STREAM_BYTES = 8 << 20


def stream_global(tensors: list, dim: int, group, rank: int, world: int, layout_code: int,
                  docs: Optional[tuple] = None):
    """Every rank's shards of `tensors` (their tokens along `dim`, as gather_global) in global
    order, a part at a time: yields (begin, parts), the tokens [begin, begin + n) of each. Each
    part starts a document (the sequence) or a multiple of invariant_row_band() tokens into it, so
    the kernels' fixed-order sums continue across parts; it is at most one broadcast of a rank's
    run plus fewer than invariant_row_band() tokens carried from the broadcast before. Each run is
    broadcast by its owner in broadcasts of about _STREAM_BYTES (one per tensor: the owner's
    are views), the next one while the caller works on the current part. Compiled
    (traced collectives have no broadcast): one part, every token (gather_global)."""
    if torch.compiler.is_compiling():
        yield 0, gather_global(tensors, dim, group, rank, world, layout_code, docs)
        return
    align = torch.ops.cpattn.invariant_row_band()
    local = tensors[0].shape[dim]
    sources = [t.movedim(dim, 0) for t in tensors]
    runs = global_runs(layout_code, world, local, docs)
    token_bytes = sum(s[0].numel() * s.element_size() for s in sources)
    step = max(align, _STREAM_BYTES // token_bytes)  # tokens per broadcast
    order = sorted((g + i, r, b + i, min(step, n - i)) for r in range(world)
                   for b, n, g in runs[r] for i in range(0, n, step))
    doc_starts = [begin for _, begin, _ in doc_shards(layout_code, world, local, docs)]

    def receive(sent):  # start the owner's broadcasts of one stretch of every tensor
        _, owner, begin, n = sent
        bufs = [src.narrow(0, begin, n).contiguous() if owner == rank else
                src.new_empty((n, *src.shape[1:])) for src in sources]
        root = dist.get_global_rank(group, owner)
        return bufs, [dist.broadcast(b, root, group=group, async_op=True) for b in bufs]

    def as_parts(bufs):
        return [b.movedim(0, dim) for b in bufs]

    carry, carry_begin = None, 0
    pending = receive(order[0])
    for i, sent in enumerate(order):
        bufs, works = pending
        if i + 1 < len(order):
            pending = receive(order[i + 1])
        for w in works:
            w.wait()
        begin = sent[0]
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
