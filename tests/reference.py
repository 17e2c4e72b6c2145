"""The float64 reference (cpattn.testing.reference), by the name the tests import it under, and
the check of a sharded run against it."""

import torch
import torch.distributed as dist

from cpattn.testing.reference import Window, reference_attention, visible_mask  # noqa: F401


def compare_sharded(what: str, run, shard, unshard, positions, full: tuple, causal: bool, window,
                    kwargs: dict, tol: float, grad_tol: float = 5.0) -> None:
    """Runs `run` on the shards of the full (q, k, v, dout) and checks it against the reference:
    out (to `tol`), LSE, dq / dk / dv and the sinks' gradient (summed over the ranks; to
    grad_tol * tol, relative to the gradient's largest element); padding rows (positions -1)
    must be exactly out 0 and LSE -inf (with sinks: the sink). Runs on every rank of a group.
    shard(t) / unshard(t, dim=1): the sharding of `run`; positions: this rank's (-1: padding)."""
    q, k, v, dout = full
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_kwargs = dict(kwargs)
    if "sinks" in kwargs:
        kwargs = dict(kwargs, sinks=kwargs["sinks"].clone().requires_grad_())
        ref_kwargs["sinks"] = kwargs["sinks"].detach().double().requires_grad_()
    ref_out, ref_lse = reference_attention(*ref_leaves, causal=causal, window=window,
                                           **ref_kwargs)
    ref_out.backward(dout.double())

    shards = [shard(t).requires_grad_() for t in (q, k, v)]
    out, lse = run(*shards, causal=causal, window=window, return_lse=True, **kwargs)
    assert out.shape[-1] == v.shape[-1] and out.dtype == q.dtype, what
    padding = positions < 0
    assert torch.equal(out[:, padding], torch.zeros_like(out[:, padding])), what
    pad_lse = lse[:, :, padding]
    if "sinks" in kwargs:
        assert torch.equal(pad_lse, kwargs["sinks"].detach()[None, :, None].expand_as(pad_lse))
    else:
        assert bool((pad_lse == float("-inf")).all()), what
    out.backward(shard(dout))

    torch.testing.assert_close(unshard(out.detach()).double(), ref_out.detach(), atol=tol,
                               rtol=tol, msg=lambda m: f"out {what}: {m}")
    full_lse = unshard(lse.detach(), 2)
    finite = ref_lse.isfinite()
    assert torch.equal(full_lse.isfinite(), finite), what
    torch.testing.assert_close(full_lse[finite].double(), ref_lse.detach()[finite], atol=2e-5,
                               rtol=2e-5, msg=lambda m: f"lse {what}: {m}")
    pairs = [(name, unshard(s.grad), r) for name, s, r in zip("qkv", shards, ref_leaves)]
    if "sinks" in kwargs:
        dsinks = kwargs["sinks"].grad.clone()
        dist.all_reduce(dsinks)  # the parameter-gradient reduction of a trainer
        pairs.append(("sinks", dsinks, ref_kwargs["sinks"]))
    for name, g, r in pairs:
        scale = max(1.0, r.grad.abs().max().item())
        torch.testing.assert_close(g.double(), r.grad, atol=grad_tol * tol * scale,
                                   rtol=grad_tol * tol,
                                   msg=lambda m: f"d{name} {what}: {m}")


def varlen_reference(q, k, v, dout, lengths, causal, window, sinks=None, softcap=0.0,
                     prefix_len=0, **options):
    """Packed documents (q (T, H, D), k / v (T, Hkv, D), dout (T, H, Dv)), each attending only
    to itself: float64 attention per document, concatenated. Returns out (T, H, Dv), lse (H, T),
    [dq, dk, dv] and the sinks' gradient summed over the documents (None without sinks).
    prefix_len: one prefix for every document, or a tensor of one per document; options: the
    rest of reference_attention's (scale, alibi_slopes), the same for every document."""
    outs, lses, grads = [], [], [[], [], []]
    s64 = None if sinks is None else sinks.detach().double().requires_grad_()
    start = 0
    for d, n in enumerate(lengths):
        if n == 0:
            continue
        piece = [t[start:start + n].detach().double()[None].requires_grad_() for t in (q, k, v)]
        prefix = int(prefix_len[d]) if isinstance(prefix_len, torch.Tensor) else prefix_len
        out, lse = reference_attention(*piece, causal=causal, window=window, sinks=s64,
                                       softcap=softcap, prefix_len=prefix, **options)
        out.backward(dout[start:start + n].double()[None])
        outs.append(out.detach()[0])
        lses.append(lse.detach()[0])
        for g, p in zip(grads, piece):
            g.append(p.grad[0])
        start += n
    return (torch.cat(outs), torch.cat(lses, dim=1), [torch.cat(g) for g in grads],
            None if s64 is None else s64.grad)

