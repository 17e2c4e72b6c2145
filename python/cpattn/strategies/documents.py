"""Attention over a cpattn.DocumentPlan: the split documents by the ring (or the all-gather), as
ring_attention_varlen runs packed documents, and each rank's whole documents by the local
varlen kernel, without communication. Only the split documents' K/V travel."""

from typing import Optional

import torch

from cpattn._agreement import agree_on, digest_ints
from cpattn._layout import LAYOUTS
from cpattn._validation import check_choice, check_int, check_timeout, error
from cpattn.attention import LocalDocuments
from cpattn.documents import DocumentPlan
from cpattn.sharding import group_info
from cpattn.strategies.allgather import GatheredAttention, default_head_group
from cpattn.strategies.common import checked_call

PLAN_STRATEGIES = ("ring", "allgather", "auto")


def _prefixes(what: str, prefix, plan: DocumentPlan) -> Optional[torch.Tensor]:
    """One prefix per document (int64 (D,)) when prefix_len is a tensor, else None (an int
    is checked with the other options). The plan was made for these prefixes or none."""
    if not isinstance(prefix, torch.Tensor):
        return None
    if prefix.dtype != torch.int64 or tuple(prefix.shape) != (len(plan.lengths),):
        raise error(what, "prefix_len", tuple(prefix.shape), f"a prefix per document must be "
                    f"an int64 tensor ({len(plan.lengths)},)")
    values = prefix.detach().cpu()
    lengths = torch.tensor(plan.lengths, dtype=torch.int64)
    bad = (values < 0) | (values > lengths)
    if bool(bad.any()):
        d = int(bad.nonzero()[0])
        raise error(what, f"prefix_len[{d}]", int(values[d]), f"must be between 0 and the "
                    f"document's length {plan.lengths[d]}")
    return values


def _documents(plan: DocumentPlan, docs: tuple, prefix: Optional[torch.Tensor]):
    """The ops' documents argument for the documents `docs`: their lengths, and with a prefix
    per document, the prefixes as a second row."""
    lengths = torch.tensor([plan.lengths[d] for d in docs], dtype=torch.int64)
    return lengths if prefix is None else torch.stack([lengths, prefix[list(docs)]])


def plan_attention(what, q, k, v, plan: DocumentPlan, group, layout, strategy, allgather_chunk,
                   ring_chunk, timeout, options: dict, return_max_logits: bool):
    """ring_attention_varlen(q, k, v, plan): out (T_r, H, Dv) and lse (H, T_r) of this rank's
    T_r tokens of the plan."""
    from cpattn.strategies.ring import RingAttention, auto_strategy

    group, rank, world = group_info(group)
    timeout = check_timeout(what, timeout)
    prefix = options.get("prefix_len", 0)

    def check():
        if plan.world != world:
            raise error(what, "cu_seqlens", "<DocumentPlan>", f"is a plan for {plan.world} "
                        f"ranks; the group has {world}")
        if layout != plan.layout:
            raise error(what, "layout", layout, f"differs from the plan's {plan.layout!r}")
        opts, fields = checked_call(what, q, k, v, {**options, "prefix_len": 0}
                                    if isinstance(prefix, torch.Tensor) else options,
                                    plan.layout, varlen=True, empty_tokens=True)
        # Ranks hold different numbers of tokens: each checks its own against the plan.
        fields = [f for f in fields if not f[0].endswith(".tokens")]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[0] != plan.tokens[rank]:
                raise error(what, f"{name}.shape[0]", t.shape[0], f"must be rank {rank}'s "
                            f"{plan.tokens[rank]} tokens of the plan (DocumentPlan.shard)")
        check_choice(what, "strategy", strategy, PLAN_STRATEGIES)
        if return_max_logits:
            raise error(what, "return_max_logits", True, "is not supported over a "
                        "DocumentPlan (pass cu_seqlens for per-document sharding)")
        mask = (opts.causal, opts.window)
        if mask != (plan.causal, plan.window):
            raise error(what, "causal/window", mask, f"differ from the plan's "
                        f"{(plan.causal, plan.window)}: shard_documents balances the work "
                        "of the mask it is given")
        chunk, r_chunk = (None if c is None else check_int(what, name, c, minimum=1)
                          for name, c in (("allgather_chunk", allgather_chunk),
                                          ("ring_chunk", ring_chunk)))
        if r_chunk is not None and strategy == "allgather":
            raise error(what, "ring_chunk", r_chunk, 'sets the passes of strategy "ring" (or '
                        '"auto"); the all-gather takes allgather_chunk')
        prefixes = _prefixes(what, prefix, plan)
        fields += [("plan", plan.signature), ("strategy", strategy), ("allgather_chunk", chunk),
                   ("ring_chunk", r_chunk),
                   ("prefix_per_document", None if prefixes is None
                    else digest_ints(prefixes.tolist()))]
        if strategy == "auto":
            fields += [("requires_grad", torch.is_grad_enabled()
                        and any(t.requires_grad for t in (q, k, v)))]
        return (opts, chunk, r_chunk, prefixes), fields

    opts, chunk, ring_chunk, prefixes = agree_on(what, group, timeout, check)
    n = plan.split_tokens
    parts = []
    if plan.split:  # the only part that communicates
        docs = _documents(plan, plan.split, prefixes)
        qs, ks, vs = q[None, :n], k[None, :n], v[None, :n]
        chosen = strategy
        if strategy == "auto":  # the faster for the split documents alone
            c = auto_strategy(qs, ks, world, group, opts, plan.layout, docs.view(-1, len(
                plan.split))[0], chunk, ring_chunk, what)
            chosen = c.strategy
            if chosen == "ring":
                ring_chunk = c.chunk or None
        if chosen == "ring":
            parts.append(RingAttention.apply(qs, ks, vs, opts.sinks, opts, group.group_name,
                                             LAYOUTS[plan.layout], timeout, docs,
                                             ring_chunk or k.shape[1]))
        else:
            parts.append(GatheredAttention.apply(qs, ks, vs, opts.sinks, opts, group, rank,
                                                 world, LAYOUTS[plan.layout], docs,
                                                 chunk or default_head_group(k.shape[1], world)))
    if plan.whole[rank]:
        docs = _documents(plan, plan.whole[rank], prefixes)
        parts.append(LocalDocuments.apply(q[None, n:], k[None, n:], v[None, n:], opts.sinks,
                                          docs, opts))
    if not parts:  # a rank without tokens: empty results, still in the autograd graph
        out = q.narrow(-1, 0, 1).mul(0).expand(0, q.shape[1], v.shape[-1])
        return out, q.new_empty((q.shape[1], 0), dtype=torch.float32)
    if len(parts) == 1:
        out, lse = parts[0]
    else:
        out, lse = torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 2)
    return out[0], lse[0]
