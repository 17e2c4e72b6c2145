"""cpattn as a transformers attention implementation (through the public `AttentionInterface`).

    cp = cpattn.ContextParallel(group, strategy="ring")          # once, on every rank
    name = cpattn.integrations.transformers.register(cp)         # "cpattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    batch = cpattn.shard_batch({"input_ids": ids, "labels": ids}, cp)
    labels = batch.pop("shift_labels")        # for cross_entropy, not the model
    logits = model(**batch, use_cache=False).logits
    loss = cpattn.cross_entropy(logits, labels, cp)

transformers calls the attention function with q / k / v as (batch, heads, seqlen, head_dim);
cpattn works on (batch, seqlen, heads, head_dim): the function transposes views, never expands
the GQA K/V heads, and returns (batch, seqlen, heads, head_dim) as transformers expects.

Every keyword the model passes is either honoured exactly or raises (`_model_checks.score_options`
is the one place that maps them): scaling, causal or bidirectional, `sliding_window` (causal or
bidirectional, on global positions), GQA, attention sinks (gpt-oss's `s_aux`, the module's
learnable `sinks`: cpattn's `sinks=`, with their gradient), logit softcapping (Gemma 2's
`softcap`: `softcap=`), `alibi_slopes` (`alibi_slopes=`) and packed documents
(`cpattn_documents`, from `cpattn.shard_batch`). A padding mask, dropout > 0, a general score
bias (`position_bias`), cross-attention, attention weights, flash varlen keywords and any
keyword this module does not know raise ValueError, the same on every rank. What the model
computes outside the call is checked in `_model_checks` (token mixers, mask functions, Llama 4's
position arithmetic). `position_ids` must be the tokens' position ids from `cpattn.shard_batch`,
else ValueError on every rank (checked once per forward and agreed over the ranks; compiled:
in the graph, by an all-reduced flag, RuntimeError).

Generation: `ContextParallelCache` is a transformers `Cache` whose layers are cpattn
`KVCacheShard`s: `model.generate(..., cache=ContextParallelCache(cp, model.config, capacity))`
(transformers 5's name; `past_key_values=` is its deprecated alias) on every rank, with the full
prompt on every rank. Prompt attention runs sharded through `cpattn.prefill_attention` (the
leading multiple of the layout granularity) and `cpattn.decode_attention` (the rest, and every
new token); the cache holds each token's K/V on one rank only. Everything outside attention
(embeddings, MLPs, logits) runs replicated. Sinks, sliding windows, softcap and ALiBi are honoured
there too; bidirectional attention raises.
"""

from __future__ import annotations

import atexit
import gc
from typing import Optional

import torch

from cpattn.attention import attention
from cpattn.core.agreement import reads_on_host
from cpattn.core.device import to_device
from cpattn.core.options import AttentionOptions
from cpattn.integrations._generation import PENDING, ContextParallelCache
from cpattn.integrations._model_checks import (
    TRAINER_ADVICE,
    WHAT,
    agree,
    attention_chunk,
    check_config,
    check_layer,
    check_mask_function,
    score_options,
    short,
)
from cpattn.integrations.hybrid.parallelize import ParallelHandle, handle_of
from cpattn.integrations.hybrid.parallelize import parallelize as _parallelize
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import KEYWORD, Documents, chunk_boundaries
from cpattn.strategies.ulysses import ulysses_attention_varlen

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
except ImportError as e:  # pragma: no cover - only without transformers
    raise ImportError(
        "cpattn.integrations.transformers needs the transformers package (pip install "
        "transformers); cpattn itself does not"
    ) from e

__all__ = ["ContextParallelCache", "ParallelHandle", "handle_of", "parallelize", "register",
           "registered"]

def _expected_positions(cp: ContextParallel, local_len: int, docs: Optional[Documents],
                        device) -> torch.Tensor:
    """The position ids RoPE must have seen for this rank's tokens."""
    if docs is not None:
        return to_device(cp.document_positions(docs)[1], device)
    return cp.positions(local_len * cp.world_size, device=device)


def _check_positions(cp: ContextParallel, module: torch.nn.Module,
                     position_ids: Optional[torch.Tensor], local_len: int,
                     docs: Optional[Documents], passed_whole_batch: bool) -> None:
    """position_ids (batch or 1, local) must be this rank's tokens' position ids from
    cpattn.shard_batch (global positions; with packed documents, positions within the
    documents), else RoPE was wrong. Checked once per position tensor (every layer gets the same
    one) and agreed over the ranks, so a mismatch on one rank raises on every rank. Under
    torch.compile, and for position ids on a GPU (reading them would sync the host; rank-check
    mode "always" reads them anyway): on the device, at the model's first layer (layer_idx 0),
    by one all-reduce of a flag (a device-side assert on every rank)."""
    if position_ids is None:
        if getattr(module, "use_rope", True) is False or passed_whole_batch:
            return  # (Llama 4's NoPE layers; the batch of shard_batch, its positions with it)
        raise ValueError(
            f"{WHAT}: {type(module).__name__} gets no position_ids from its decoder layer, so "
            "cpattn cannot check that the model used the tokens' global positions (given none, "
            "a model uses each rank's local positions: silently wrong). Pass the whole batch of "
            "cpattn.shard_batch to the model (model(**batch) without 'shift_labels'): its "
            f"position_ids with its {KEYWORD!r}, which tells cpattn they were passed")
    if torch.compiler.is_compiling() or not reads_on_host(position_ids):
        if getattr(module, "layer_idx", 0) == 0:
            _check_positions_on_device(cp, position_ids, local_len, docs)
        return
    last = _CHECKED.get(id(cp))
    if last is not None and last[0] is position_ids and last[1] == (position_ids._version,
                                                                   local_len, docs):
        return

    def check():
        expected = _expected_positions(cp, local_len, docs, position_ids.device)
        if position_ids.shape[-1] != local_len or not bool((position_ids == expected).all()):
            if docs is None and _unsharded(position_ids):
                raise ValueError(
                    f"{WHAT}: position_ids are not the position ids of this rank's tokens but "
                    "0, 1, 2, ... (what a model uses when given none): the model got a whole "
                    f"batch, or a shard without its position ids. {TRAINER_ADVICE}; in a loop "
                    "of your own, give the model the whole batch of cpattn.shard_batch (its "
                    "position_ids with it)")
            packed = " (packed documents: give the whole batch to shard_batch, and pass its " \
                "'cpattn_documents' to the model too)" if docs is None else ""
            raise ValueError(
                f"{WHAT}: position_ids are not the position ids of this rank's tokens (rank "
                f"{cp.rank} of {cp.world_size}, layout {cp.layout!r}): pass "
                "position_ids=cpattn.shard_batch(...)['position_ids'] to the model, else RoPE "
                f"sees other positions and the model is wrong{packed}")

    agree(cp, WHAT, check)
    _CHECKED[id(cp)] = (position_ids, (position_ids._version, local_len, docs))


def _unsharded(position_ids: torch.Tensor) -> bool:
    """Whether every row's position ids are 0, 1, ..., n-1: the ones a model makes when given
    none (a whole batch as a loader gives it, or a shard without its positions). Called when
    they are wrong: the first rank of the contiguous layout rightly has them."""
    steps = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return bool((position_ids == steps).all())


def _check_positions_on_device(cp: ContextParallel, position_ids: torch.Tensor, local_len: int,
                               docs: Optional[Documents]) -> None:
    """_check_positions without reading the values on the host (inside a compiled graph, or on a
    GPU): asserted on the device on every rank."""
    if position_ids.shape[-1] != local_len:
        raise ValueError(f"{WHAT}: position_ids hold {position_ids.shape[-1]} positions for "
                         f"{local_len} local tokens")
    expected = _expected_positions(cp, local_len, docs, position_ids.device)
    _assert_on_every_rank(cp, (position_ids != expected).any(),
                          f"{WHAT}: position_ids are not the position ids of the tokens on some "
                          "rank: pass position_ids=cpattn.shard_batch(...)['position_ids'] to "
                          "the model, else RoPE sees other positions (0, 1, 2, ... on every "
                          f"rank: a whole batch, not a shard. {TRAINER_ADVICE})")


def _assert_on_every_rank(cp: ContextParallel, failed: torch.Tensor, message: str) -> None:
    """Asserts that the bool scalar `failed` is False on every rank of cp's sequence, without a
    host sync: the ranks' flags are all-reduced (max) on the device and asserted there
    (torch._assert_async), so a failure on any rank fails every rank."""
    import torch.distributed._functional_collectives as funcol

    flag = failed.to(torch.int32).reshape(1)
    for group in cp.groups:
        flag = funcol.all_reduce(flag, "max", group)
    torch._assert_async(flag[0] == 0, message)


# id(settings) -> (the position tensor last checked, (its version, length, documents)): the
# tensor is held, so that its id cannot be reused by another tensor while it is remembered.
_CHECKED: dict[int, tuple] = {}


def _attention_forward(cp: ContextParallel, module: torch.nn.Module, query: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                       scaling: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function: query (B, H, S, D), key / value (B, Hkv, S, D) of this
    rank's tokens. Returns ((B, S, H, D), None)."""
    if attention_mask is not None:
        raise ValueError(
            f"{WHAT}: the model passes an attention mask (padding, or a custom 4-D mask): cpattn "
            "cannot apply it under context parallelism. Give the padded batch (with its "
            "attention_mask) to cpattn.shard_batch, which unpacks it into documents, and pass "
            "no attention_mask to the model")
    opts = score_options(module, query.shape[-1], scaling, dropout, kwargs)
    docs = kwargs.get(KEYWORD)
    if docs is not None and not isinstance(docs, Documents):
        raise ValueError(f"{WHAT}: {KEYWORD} must be the cpattn.sharding.packing.Documents that "
                         f"cpattn.shard_batch made, got {short(docs)}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    layer = PENDING.pop(id(key), None)
    if layer is None and PENDING:
        PENDING.clear()
        raise ValueError(
            f"{WHAT}: ContextParallelCache stored K/V that the attention did not receive: "
            f"{type(module).__name__} changes what it caches before attending (MLA models such "
            "as DeepSeek-V3 cache latents and expand them after the cache), so the sharded cache "
            "cannot serve it; generate without context parallelism for this model")
    if layer is not None and layer.pending[0] is key:
        if docs is not None:
            raise ValueError(f"{WHAT}: ContextParallelCache generates from one prompt per row, "
                             "not from packed documents")
        return layer.attend(module, q, k, v, opts), None
    if kwargs.get("use_cache") or key.shape[2] != query.shape[2]:
        # A transformers cache here would hold this rank's shard of K/V: useless for decoding.
        raise ValueError(
            f"{WHAT}: the model caches K/V (use_cache=True, transformers' default, or a cache "
            "other than ContextParallelCache): pass use_cache=False to the model (or set "
            "config.use_cache = False) for training, and cache=ContextParallelCache(...) to "
            "generate"
        )
    q, k, v = _autocast(q, k, v)
    tokens = docs.tokens if docs is not None else q.shape[1] * cp.world_size
    max_position = docs.max_position if docs is not None else tokens - 1
    chunk = attention_chunk(module)
    # (past one chunk: exact over one process group; the hybrid's two raise in check_layer)
    chunked = chunk is not None and max_position >= chunk and cp.group is not None
    check_layer(module, tokens, max_position, chunks=chunked)
    _check_positions(cp, module, kwargs.get("position_ids"), q.shape[1], docs,
                     KEYWORD in kwargs)
    if chunked and cp.spec.splits_heads:
        return _chunked_ulysses(cp, q, k, v, opts, docs, chunk), None
    if chunked:
        return _chunked_gathered(cp, q, k, v, opts, docs, chunk), None
    out = cp.attention(q, k, v, documents=docs, **opts.as_keywords())
    return out, None


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast (mixed-precision training: fp32 weights, bf16 / fp16 compute) q, k and v
    arrive in different dtypes (RoPE keeps q and k in fp32); like SDPA under autocast, attention
    runs in the autocast dtype."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def _chunked_ulysses(cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     opts: AttentionOptions, docs: Optional[Documents], chunk: int) -> torch.Tensor:
    """Chunked attention (Llama 4) past one chunk, exactly: Ulysses over the documents (each row
    of a batch of sequences is one, sharded contiguously), attending in pieces cut at every
    multiple of `chunk` of the documents' positions."""
    batch, local = q.shape[:2]
    if docs is None:
        lengths, starts = (local * cp.world_size,) * batch, (0,) * batch
    else:
        lengths, starts = docs.lengths, docs.starts
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    out = ulysses_attention_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), bounds, group=cp.group,
        attend_cu_seqlens=chunk_boundaries(lengths, starts, chunk), timeout=cp.timeout,
        **cp.with_mode(opts.as_keywords()))
    return out.view(batch, local, *out.shape[1:])


def _chunked_gathered(cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      opts: AttentionOptions, docs: Optional[Documents],
                      chunk: int) -> torch.Tensor:
    """Chunked attention (Llama 4) past one chunk under the ring or the all-gather, exactly: the
    chunks are documents of `chunk` positions (of each document's own positions). K and V are
    gathered whole (cp.unshard, whose backward returns each token's gradient to its owner); each
    run of local queries at consecutive positions of one chunk attends the keys from its
    chunk's start up to its own end (the local kernel, bottom-right aligned: every query at its
    own position). Padding slots of a packed batch get 0. Costs the all-gather's memory: the
    layer's whole K and V on every rank."""
    if opts.invariant:
        raise ValueError(f"{WHAT}: invariant=True with chunked attention past one chunk runs "
                         "with strategy 'ulysses' only (ContextParallel(strategy='ulysses'))")
    if docs is None:  # each row one sequence in the layout
        total = q.shape[1] * cp.world_size
        index = cp.positions(total).tolist()
        cuts = chunk_boundaries((total,), (0,), chunk)
    else:  # one packed row
        index = cp.document_positions(docs)[0].tolist()
        cuts = chunk_boundaries(docs.lengths, docs.starts, chunk)
    k_all, v_all = (cp.unshard(t, documents=docs) for t in (k, v))
    piece_start = {}  # packed index -> the start of its chunk piece
    for start, end in zip(cuts, cuts[1:]):
        piece_start.update(dict.fromkeys(range(start, end), start))
    keywords = opts.replace(causal=True).as_keywords()
    outs, t = [], 0
    while t < len(index):  # local runs: consecutive packed indices in one piece, or padding
        u = t + 1
        if index[t] < 0:
            while u < len(index) and index[u] < 0:
                u += 1
            outs.append(q.new_zeros(*q.shape[:1], u - t, *q.shape[2:3], *v.shape[3:]))
        else:
            while (u < len(index) and index[u] == index[u - 1] + 1
                   and piece_start[index[u]] == piece_start[index[t]]):
                u += 1
            first, end = piece_start[index[t]], index[u - 1] + 1
            outs.append(attention(q[:, t:u], k_all[:, first:end], v_all[:, first:end],
                                  **keywords))
        t = u
    return torch.cat(outs, dim=1)


def _calls_attention_interface(model_type: str) -> bool:
    """Whether transformers' model class for `model_type` computes attention through the
    AttentionInterface (`_supports_attention_backend`); True when the type is not known here.
    Not cached: a cache filled while tracing would change a guarded global and recompile."""
    model_class = getattr(transformers, MODEL_MAPPING_NAMES.get(model_type, ""), None)
    return getattr(model_class, "_supports_attention_backend", True)


def _mask(cp: ContextParallel, parallelized: bool, *args,
          attention_mask: Optional[torch.Tensor] = None, config=None, mask_function=None,
          **kwargs):
    """The AttentionMaskInterface function, called by the model before its layers: refuses (on
    every rank: the same config everywhere) a model that mixes tokens outside attention or
    builds a mask cpattn does not apply; builds no mask (cpattn applies causality, windows and
    documents on global positions). A 2-D padding mask that is not all ones raises on every
    rank (shard_batch unpads padded batches). A model that builds its mask here but computes
    attention in its own code (Bloom, MPT: they accept any attn_implementation) would attend
    within each rank's shard only: it raises too."""
    check_config(config, parallelized)
    model_type = getattr(config, "model_type", None)
    # (a parallelized model was checked by its modules: attention through the interface)
    if model_type is not None and not parallelized and not _calls_attention_interface(model_type):
        raise ValueError(f"{WHAT}: the {model_type!r} model computes attention in its own code "
                         "and never calls the attention interface, so cpattn cannot run it: "
                         "under context parallelism each rank would attend to its own shard "
                         "only. Use a model whose transformers class supports attention "
                         "backends (Llama, Mistral, Qwen, Gemma, gpt-oss, ...)")
    check_mask_function(mask_function)
    if attention_mask is None:
        return None
    if torch.compiler.is_compiling():
        return attention_mask  # the attention refuses it (values unknown while tracing)

    padding = (f"{WHAT}: the model was given an attention_mask with padding (zeros): cpattn "
               "cannot apply a padding mask under context parallelism. Give the padded batch "
               "to cpattn.shard_batch (it unpacks the rows into documents) and pass no "
               "attention_mask to the model")
    if not reads_on_host(attention_mask):  # (a GPU mask: reading it would sync the host)
        _assert_on_every_rank(cp, ~attention_mask.all(), padding)
        return None

    def all_ones():
        if not bool(attention_mask.all()):
            raise ValueError(padding)

    agree(cp, WHAT, all_ones)
    return None


# name -> the settings registered under it. The functions handed to transformers look them up
# here instead of holding them: transformers' registry lives until the interpreter's teardown, and
# through cp it would keep the process group (and gloo's threads) alive past
# dist.destroy_process_group, to be torn down only then (see _forget_settings).
_SETTINGS: dict[str, ContextParallel] = {}


def _forget_settings() -> None:
    """At exit, before the interpreter's teardown: drops the registered settings, so that a
    process group the user destroyed is freed now, its threads joined, and not during the
    teardown (where destroying a thread still running aborts: "terminate called without an
    active exception")."""
    _SETTINGS.clear()
    PENDING.clear()
    _CHECKED.clear()
    gc.collect()


def registered(name: Optional[str]) -> Optional[ContextParallel]:
    """The settings registered (by `register`) as the attention implementation `name`, or
    None."""
    return _SETTINGS.get(name)


def register(cp: ContextParallel, name: str = "cpattn") -> str:
    """Registers cpattn with the settings `cp` as the transformers attention implementation
    `name` (and its mask function). Returns `name`: pass it as `attn_implementation=` to
    from_pretrained / from_config, or to model.set_attn_implementation. Registering the same name
    again replaces the settings. For models whose only token mixing is attention: a model with
    other token mixers is refused at its first forward (by its config), naming `parallelize`,
    which is the way for every model."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"{WHAT}.register: cp must be a cpattn.ContextParallel, got {type(cp)}")
    if name.startswith(_PARALLEL_PREFIX):
        raise ValueError(f"{WHAT}.register: names starting with {_PARALLEL_PREFIX!r} are "
                         f"parallelize's, got {name!r}")
    return _register(cp, name, parallelized=False)


def _register(cp: ContextParallel, name: str, parallelized: bool) -> str:
    if not _SETTINGS:
        atexit.register(_forget_settings)  # once (empty again only after it ran)
    _SETTINGS[name] = cp

    def attention(module, query, key, value, attention_mask, **kwargs):
        return _attention_forward(_SETTINGS[name], module, query, key, value, attention_mask,
                                  **kwargs)

    def mask(*args, **kwargs):
        return _mask(_SETTINGS[name], parallelized, *args, **kwargs)

    attention.__name__ = attention.__qualname__ = f"cpattn_attention_{name}"
    mask.__name__ = mask.__qualname__ = f"cpattn_mask_{name}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


_PARALLEL_PREFIX = "cpattn_parallel"


def parallelize(model, cp: ContextParallel, name: Optional[str] = None) -> ParallelHandle:
    """Makes this model instance context-parallel with the settings `cp`: its attention (the
    attention implementation `name`, registered for cp: by default `"cpattn_parallel"`, or the
    name already registered for this cp) and every token mixer it contains (convolutions, Mamba,
    delta rules, lightning attention: docs/hybrid-models.md), exactly; a token mixer cpattn has no
    adapter for is refused, whatever its class. Call it on every rank, after loading the weights
    and before FSDP2's fully_shard; give the model shard_batch's whole batch. Returns the handle
    whose `remove()` restores the model. A deep copy of the model is parallelized too (its handle:
    `handle_of(copy)`). See cpattn.integrations.hybrid.parallelize for what it checks and
    changes."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"{WHAT}.parallelize: cp must be a cpattn.ContextParallel, got "
                        f"{type(cp)}")
    if name is None:  # the name parallelize gave cp before, else the first one free
        name = next((n for n, c in _SETTINGS.items() if c is cp and n in _PARALLELIZED), None)
        free = (f"{_PARALLEL_PREFIX}_{i}" if i else _PARALLEL_PREFIX
                for i in range(len(_SETTINGS) + 1))
        name = name or next(n for n in free if n not in _SETTINGS)
    elif not name.startswith(_PARALLEL_PREFIX):
        raise ValueError(f"{WHAT}.parallelize: name must start with {_PARALLEL_PREFIX!r} (the "
                         f"names register() gives refuse models with token mixers), got "
                         f"{name!r}")
    _PARALLELIZED.add(_register(cp, name, parallelized=True))
    return _parallelize(model, cp, name)


# the names parallelize registered (their mask function does not refuse token mixers: the
# parallelized model's were checked by its modules)
_PARALLELIZED: set[str] = set()
