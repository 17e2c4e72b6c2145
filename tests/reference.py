"""The float64 reference (cpattn.testing.reference), by the name the tests import it under, and
the check of a sharded run against it."""

import torch
import torch.distributed as dist

from cpattn.testing.reference import Window, reference_attention, visible_mask  # noqa: F401

from tolerances import dense_tolerance, expected_of


def compare_sharded(what: str, run, shard, unshard, positions, full: tuple, causal: bool, window,
                    kwargs: dict, grad_factor: float = 5.0) -> None:
    """Runs `run` on the shards of the full (q, k, v, dout) and checks it against the reference
    within tolerances.tolerance (fp32 gradients: grad_factor times the fp32 bound): out, LSE,
    dq / dk / dv and the sinks' gradient (summed over the ranks); padding rows (positions -1)
    must be exactly out 0 and LSE -inf (with sinks: the sink). Runs on every rank of a group.
    shard(t) / unshard(t, dim=1): the sharding of `run`; positions: this rank's (-1: padding)."""
    q, k, v, dout = full
    if "sinks" in kwargs:
        kwargs = dict(kwargs, sinks=kwargs["sinks"].clone().requires_grad_())
    # The reference once, on rank 0, sent to the others (every rank holds the same full inputs).
    box = [_expected_and_tolerance(full, causal, window, kwargs, grad_factor)
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    expected, tol = box[0]

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

    got = {"out": unshard(out.detach()), "lse": unshard(lse.detach(), 2)}
    got.update((f"d{name}", unshard(s.grad)) for name, s in zip("qkv", shards))
    if "sinks" in kwargs:
        got["dsinks"] = kwargs["sinks"].grad.clone()
        dist.all_reduce(got["dsinks"])  # the parameter-gradient reduction of a trainer
    for name, want in expected.items():
        tol.check(name, got[name], want, what)


def _expected_and_tolerance(full: tuple, causal: bool, window, kwargs: dict,
                            grad_factor: float) -> tuple:
    """compare_sharded's float64 results by name, and the tolerance they get."""
    q, k, v, dout = full
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_kwargs = dict(kwargs)
    if "sinks" in kwargs:
        ref_kwargs["sinks"] = kwargs["sinks"].detach().double().requires_grad_()
    ref_out, ref_lse = reference_attention(*ref_leaves, causal=causal, window=window,
                                           **ref_kwargs)
    ref_out.backward(dout.double())
    expected = expected_of(ref_out.detach(), ref_lse.detach(), [t.grad for t in ref_leaves],
                           ref_kwargs["sinks"].grad if "sinks" in kwargs else None)
    low_options = dict(kwargs)
    if "sinks" in kwargs:
        low_options["sinks"] = kwargs["sinks"].detach()
    return expected, dense_tolerance(full, expected, grad_factor, causal=causal, window=window,
                                     **low_options)


def varlen_reference(q, k, v, dout, lengths, causal, window, sinks=None, softcap=0.0,
                     prefix_len=0, compute_dtype=torch.float64, **options):
    """Packed documents (q (T, H, D), k / v (T, Hkv, D), dout (T, H, Dv)), each attending only
    to itself: float64 attention per document, concatenated. Returns out (T, H, Dv), lse (H, T),
    [dq, dk, dv] and the sinks' gradient summed over the documents (None without sinks).
    prefix_len: one prefix for every document, or a tensor of one per document; options: the
    rest of reference_attention's (scale, alibi_slopes), the same for every document.
    compute_dtype: a low dtype measures torch's own error in it (tests/tolerances.py)."""
    outs, lses, grads = [], [], [[], [], []]
    s64 = None if sinks is None else sinks.detach().to(compute_dtype).requires_grad_()
    start = 0
    for d, n in enumerate(lengths):
        if n == 0:
            continue
        piece = [t[start:start + n].detach().to(compute_dtype)[None].requires_grad_()
                 for t in (q, k, v)]
        prefix = int(prefix_len[d]) if isinstance(prefix_len, torch.Tensor) else prefix_len
        out, lse = reference_attention(*piece, causal=causal, window=window, sinks=s64,
                                       softcap=softcap, prefix_len=prefix,
                                       compute_dtype=compute_dtype, **options)
        out.backward(dout[start:start + n].to(compute_dtype)[None])
        outs.append(out.detach()[0])
        lses.append(lse.detach()[0])
        for g, p in zip(grads, piece):
            g.append(p.grad[0])
        start += n
    return (torch.cat(outs), torch.cat(lses, dim=1), [torch.cat(g) for g in grads],
            None if s64 is None else s64.grad)

