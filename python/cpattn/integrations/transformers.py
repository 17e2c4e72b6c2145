"""cpattn as a transformers attention implementation (through the public `AttentionInterface`).

    cp = cpattn.ContextParallel(group, strategy="ring")          # once, on every rank
    name = cpattn.integrations.transformers.register(cp)         # "cpattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    batch = cpattn.shard_batch({"input_ids": ids, "labels": ids}, cp)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   use_cache=False).logits
    loss = cpattn.cross_entropy(logits, batch["shift_labels"], cp)

transformers calls the attention function with q / k / v as (batch, heads, seqlen, head_dim);
cpattn works on (batch, seqlen, heads, head_dim): the function transposes views, never expands
the GQA K/V heads, and returns (batch, seqlen, heads, head_dim) as transformers expects.

Every keyword the model passes is either honoured exactly or raises (`_score_options` is the one
place that maps them): scaling, causal or bidirectional, `sliding_window` (causal or
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
from dataclasses import dataclass
from typing import Any, Optional

import torch

from cpattn.attention import attention_varlen
from cpattn.inference import KVCacheShard, decode_attention, prefill_attention
from cpattn.integrations._model_checks import (
    agree,
    attention_chunk,
    check_config,
    check_layer,
    check_mask_function,
)
from cpattn.packing import KEYWORD, Documents, chunk_boundaries
from cpattn.parallel import ContextParallel
from cpattn.strategies.ulysses import ulysses_attention_varlen

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
except ImportError as e:  # pragma: no cover - only without transformers
    raise ImportError(
        "cpattn.integrations.transformers needs the transformers package (pip install "
        "transformers); cpattn itself does not"
    ) from e

WHAT = "cpattn.integrations.transformers"

# Keywords transformers passes that do not change the attention math.
_INERT = frozenset({"use_cache", "output_hidden_states", "output_router_logits",
                    "num_items_in_batch", "return_dict", "cache_position", "layer_idx",
                    "deterministic"})  # (ModernBERT: flash-attn's deterministic backward)
# Keywords mapped to cpattn's options (in _score_options).
_MAPPED = frozenset({"position_ids", "is_causal", "sliding_window", "softcap", "s_aux", "sinks",
                     "alibi_slopes", KEYWORD})
# Keywords that change the math and that cpattn cannot honour: value -> whether it is in use.
_UNSUPPORTED = {
    "position_bias": lambda v: v is not None,  # a general additive score bias (T5-like)
    "output_attentions": bool,
    "cu_seq_lens_q": lambda v: v is not None,  # packed sequences (flash varlen)
    "cu_seq_lens_k": lambda v: v is not None,
    "max_length_q": lambda v: v is not None,
    "max_length_k": lambda v: v is not None,
    "seq_idx": lambda v: v is not None,
    "encoder_hidden_states": lambda v: v is not None,  # cross-attention (BERT: None in encoders)
}
_MISPLACED = {"labels", "shift_labels"}  # reach attention when a batch is passed as **batch


@dataclass(frozen=True)
class _Options:
    """What one attention call of the model asks for, in cpattn's terms."""

    causal: bool
    scale: float
    window: tuple[int, int]  # (left, right) on global positions, -1: unbounded
    sinks: Optional[torch.Tensor]  # (heads,), learnable (gpt-oss); None: no sink
    softcap: float  # 0: off (Gemma 2: attn_logit_softcapping)
    alibi_slopes: Optional[torch.Tensor]  # (heads,), fixed; None: no ALiBi


def _score_options(module: torch.nn.Module, head_dim: int, scaling, dropout: float,
                   kwargs: dict[str, Any]) -> _Options:
    """Maps what transformers passes to cpattn's options, or raises. transformers 5.24 passes:
    `sliding_window` (int or None; Mistral, Gemma 2, gpt-oss: key j visible iff i - j <
    sliding_window), `softcap` (Gemma 2's attn_logit_softcapping, None: off), `s_aux` (gpt-oss:
    the module's `sinks` parameter, one logit per head; its gradient flows through cpattn).
    `alibi_slopes` (heads,) is honoured for a model that passes it (FlashAttention's name and
    convention: -slope * |i - j| added to the scaled score); transformers' own ALiBi models (Bloom,
    Falcon, MPT) compute attention in their own code and never call an attention interface."""
    if dropout:
        raise ValueError(f"{WHAT}: attention dropout {dropout} cannot be honoured (cpattn has no "
                         "attention dropout): set config.attention_dropout = 0.0")
    for name, value in kwargs.items():
        if name in _UNSUPPORTED:
            if _UNSUPPORTED[name](value):
                raise ValueError(f"{WHAT}: the model passes {name}={_short(value)}, which cpattn "
                                 "cannot honour; use another attention implementation")
        elif name in _MISPLACED:
            raise ValueError(f"{WHAT}: '{name}' reached the attention layer: pass the batch's "
                             "labels to cpattn.cross_entropy, not to the model")
        elif name not in _INERT and name not in _MAPPED:
            raise ValueError(f"{WHAT}: unknown keyword {name}={_short(value)} passed to the "
                             "attention; cpattn does not know whether it changes the math")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    window = (-1, -1)
    sliding = kwargs.get("sliding_window")
    if sliding is not None:
        if isinstance(sliding, bool) or not isinstance(sliding, int) or sliding < 1:
            raise ValueError(f"{WHAT}: sliding_window must be a positive int, got {sliding!r}")
        # transformers' (and flash-attn's) convention: key j visible iff |i - j| < sliding
        # (causal: i - j < sliding); its masks for ModernBERT's bidirectional window agree
        window = (sliding - 1, -1) if causal else (sliding - 1, sliding - 1)
    if kwargs.get("s_aux") is not None and kwargs.get("sinks") is not None:
        raise ValueError(f"{WHAT}: the model passes both s_aux and sinks; pass one")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    alibi = kwargs.get("alibi_slopes")
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{WHAT}: {name} must be a tensor of one value per head, got "
                             f"{_short(t)}")
    softcap = kwargs.get("softcap")
    softcap = 0.0 if softcap is None else softcap  # None and 0: off; cpattn checks the rest
    return _Options(causal, scale, window, sinks, softcap, alibi)


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def _expected_positions(cp: ContextParallel, local_len: int, docs: Optional[Documents],
                        device) -> torch.Tensor:
    """The position ids RoPE must have seen for this rank's tokens."""
    if docs is not None:
        return cp.document_positions(docs)[1].to(device)
    return cp.positions(local_len * cp.world_size, device=device)


def _check_positions(cp: ContextParallel, module: torch.nn.Module,
                     position_ids: Optional[torch.Tensor], local_len: int,
                     docs: Optional[Documents], passed_whole_batch: bool) -> None:
    """position_ids (batch or 1, local) must be this rank's tokens' position ids from
    cpattn.shard_batch (global positions; with packed documents, positions within the
    documents), else RoPE was wrong. Checked once per position tensor (every layer gets the same
    one) and agreed over the ranks, so a mismatch on one rank raises on every rank. Under
    torch.compile: in the graph, at the model's first layer (layer_idx 0), by one all-reduce of
    a flag (RuntimeError on every rank)."""
    if position_ids is None:
        if getattr(module, "use_rope", True) is False or passed_whole_batch:
            return  # (Llama 4's NoPE layers; the batch of shard_batch, its positions with it)
        raise ValueError(
            f"{WHAT}: {type(module).__name__} gets no position_ids from its decoder layer, so "
            "cpattn cannot check that the model used the tokens' global positions (given none, "
            "a model uses each rank's local positions: silently wrong). Pass the whole batch of "
            "cpattn.shard_batch to the model (model(**batch) without 'shift_labels'): its "
            f"position_ids with its {KEYWORD!r}, which tells cpattn they were passed")
    if torch.compiler.is_compiling():
        if getattr(module, "layer_idx", 0) == 0:
            _check_positions_in_graph(cp, position_ids, local_len, docs)
        return
    last = _CHECKED.get(id(cp))
    if last is not None and last[0] is position_ids and last[1] == (position_ids._version,
                                                                   local_len, docs):
        return

    def check():
        expected = _expected_positions(cp, local_len, docs, position_ids.device)
        if position_ids.shape[-1] != local_len or not bool((position_ids == expected).all()):
            packed = " (packed documents: give the whole batch to shard_batch, and pass its " \
                "'cpattn_documents' to the model too)" if docs is None else ""
            raise ValueError(
                f"{WHAT}: position_ids are not the position ids of this rank's tokens (rank "
                f"{cp.rank} of {cp.world_size}, layout {cp.layout!r}): pass "
                "position_ids=cpattn.shard_batch(...)['position_ids'] to the model, else RoPE "
                f"sees other positions and the model is wrong{packed}")

    agree(cp, WHAT, check)
    _CHECKED[id(cp)] = (position_ids, (position_ids._version, local_len, docs))


def _check_positions_in_graph(cp: ContextParallel, position_ids: torch.Tensor, local_len: int,
                              docs: Optional[Documents]) -> None:
    """_check_positions inside a compiled graph (the values are not known while tracing): each
    rank's mismatch flag, all-reduced (max) over cp's sequence, asserted on every rank."""
    import torch.distributed._functional_collectives as funcol

    if position_ids.shape[-1] != local_len:
        raise ValueError(f"{WHAT}: position_ids hold {position_ids.shape[-1]} positions for "
                         f"{local_len} local tokens")
    expected = _expected_positions(cp, local_len, docs, position_ids.device)
    flag = (position_ids != expected).any().to(torch.int32).reshape(1)
    groups = (cp.ulysses_group, cp.ring_group) if cp.strategy == "hybrid" else (cp.group,)
    for group in groups:
        flag = funcol.all_reduce(flag, "max", group)
    torch._assert_async(flag[0] == 0, f"{WHAT}: position_ids are not the position ids of the "
                        "tokens on some rank: pass position_ids=cpattn.shard_batch(...)"
                        "['position_ids'] to the model, else RoPE sees other positions")


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
    opts = _score_options(module, query.shape[-1], scaling, dropout, kwargs)
    docs = kwargs.get(KEYWORD)
    if docs is not None and not isinstance(docs, Documents):
        raise ValueError(f"{WHAT}: {KEYWORD} must be the cpattn.packing.Documents that "
                         f"cpattn.shard_batch made, got {_short(docs)}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    layer = _PENDING.pop(id(key), None)
    if layer is None and _PENDING:
        _PENDING.clear()
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
    tokens = docs.tokens if docs is not None else q.shape[1] * cp.world_size
    max_position = docs.max_position if docs is not None else tokens - 1
    chunk = attention_chunk(module)
    chunked = chunk is not None and max_position >= chunk and cp.strategy == "ulysses"
    check_layer(module, tokens, max_position, chunks=chunked)
    _check_positions(cp, module, kwargs.get("position_ids"), q.shape[1], docs,
                     KEYWORD in kwargs)
    if chunked:
        return _chunked_ulysses(cp, q, k, v, opts, docs, chunk), None
    out = cp.attention(q, k, v, causal=opts.causal, softmax_scale=opts.scale, window=opts.window,
                       sinks=opts.sinks, softcap=opts.softcap, alibi_slopes=opts.alibi_slopes,
                       documents=docs)
    return out, None


def _chunked_ulysses(cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     opts: _Options, docs: Optional[Documents], chunk: int) -> torch.Tensor:
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
        attend_cu_seqlens=chunk_boundaries(lengths, starts, chunk), causal=opts.causal,
        softmax_scale=opts.scale, window=opts.window, sinks=opts.sinks, softcap=opts.softcap,
        alibi_slopes=opts.alibi_slopes, timeout=cp.timeout)
    return out.view(batch, local, *out.shape[1:])


def _calls_attention_interface(model_type: str) -> bool:
    """Whether transformers' model class for `model_type` computes attention through the
    AttentionInterface (`_supports_attention_backend`); True when the type is not known here.
    Not cached: a cache filled while tracing would change a guarded global and recompile."""
    model_class = getattr(transformers, MODEL_MAPPING_NAMES.get(model_type, ""), None)
    return getattr(model_class, "_supports_attention_backend", True)


def _mask(cp: ContextParallel, *args, attention_mask: Optional[torch.Tensor] = None, config=None,
          mask_function=None, **kwargs):
    """The AttentionMaskInterface function, called by the model before its layers: refuses (on
    every rank: the same config everywhere) a model that mixes tokens outside attention or
    builds a mask cpattn does not apply; builds no mask (cpattn applies causality, windows and
    documents on global positions). A 2-D padding mask that is not all ones raises on every
    rank (shard_batch unpads padded batches). A model that builds its mask here but computes
    attention in its own code (Bloom, MPT: they accept any attn_implementation) would attend
    within each rank's shard only: it raises too."""
    model_type = getattr(config, "model_type", None)
    if model_type is not None and not _calls_attention_interface(model_type):
        raise ValueError(f"{WHAT}: the {model_type!r} model computes attention in its own code "
                         "and never calls the attention interface, so cpattn cannot run it: "
                         "under context parallelism each rank would attend to its own shard "
                         "only. Use a model whose transformers class supports attention "
                         "backends (Llama, Mistral, Qwen, Gemma, gpt-oss, ...)")
    check_config(config)
    check_mask_function(mask_function)
    if attention_mask is None:
        return None
    if torch.compiler.is_compiling():
        return attention_mask  # the attention refuses it (values unknown while tracing)

    def all_ones():
        if not bool(attention_mask.all()):
            raise ValueError(
                f"{WHAT}: the model was given an attention_mask with padding (zeros): cpattn "
                "cannot apply a padding mask under context parallelism. Give the padded batch "
                "to cpattn.shard_batch (it unpacks the rows into documents) and pass no "
                "attention_mask to the model")

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
    _PENDING.clear()
    _CHECKED.clear()
    gc.collect()


def register(cp: ContextParallel, name: str = "cpattn") -> str:
    """Registers cpattn with the settings `cp` as the transformers attention implementation
    `name` (and its mask function). Returns `name`: pass it as `attn_implementation=` to
    from_pretrained / from_config, or to model.set_attn_implementation. Registering the same name
    again replaces the settings."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"{WHAT}.register: cp must be a cpattn.ContextParallel, got {type(cp)}")
    if not _SETTINGS:
        atexit.register(_forget_settings)  # once (empty again only after it ran)
    _SETTINGS[name] = cp

    def attention(module, query, key, value, attention_mask, **kwargs):
        return _attention_forward(_SETTINGS[name], module, query, key, value, attention_mask,
                                  **kwargs)

    def mask(*args, **kwargs):
        return _mask(_SETTINGS[name], *args, **kwargs)

    attention.__name__ = attention.__qualname__ = f"cpattn_attention_{name}"
    mask.__name__ = mask.__qualname__ = f"cpattn_mask_{name}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


# ---------------------------------------------------------------------------------------------
# Generation: a transformers Cache over cpattn's sharded KV cache

_PENDING: dict[int, "_ShardedLayer"] = {}  # id(key handed to attention) -> its cache layer


class _ShardedLayer(CacheLayerMixin):
    """One layer's cache: this rank's KVCacheShard. update() does not concatenate: it hands the
    new K/V to the attention function, which stores them in the owners' shards and attends."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cp: ContextParallel, capacity: int, interleave: int) -> None:
        super().__init__()
        self.cp, self.capacity, self.interleave = cp, capacity, interleave
        self.shard: Optional[KVCacheShard] = None
        self.pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hkv, _, d = key_states.shape
        self.shard = KVCacheShard(b, self.capacity, hkv, d, interleave=self.interleave,
                                  group=self.cp.group, dtype=key_states.dtype,
                                  device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.shard is None:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        _PENDING[id(key_states)] = self
        return key_states, value_states

    def attend(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, opts: _Options) -> torch.Tensor:
        """q (B, n, H, D), k / v (B, n, Hkv, D): the n new tokens, the same on every rank.
        Stores their K/V in the sharded cache; returns their attention output (B, n, H, D)."""
        self.pending = None
        past = self.get_seq_length()
        # (temperature tuning sees the global positions here; chunks: _attend_chunked)
        check_layer(module, 0, past + q.shape[1] - 1, chunks=True)
        if not opts.causal:
            raise ValueError(f"{WHAT}: ContextParallelCache supports causal attention only (a "
                             "decoder's); got causal=False")
        options = dict(softmax_scale=opts.scale, sinks=opts.sinks, softcap=opts.softcap,
                       alibi_slopes=opts.alibi_slopes, window=opts.window, timeout=self.cp.timeout)
        chunk = attention_chunk(module)
        if chunk is not None and past + q.shape[1] > chunk:
            return self._attend_chunked(q, k, v, options, chunk)
        cp, shard = self.cp, self.shard
        n = q.shape[1]
        lead = n - n % cp.granularity
        outs = []
        if lead:
            # The prompt's leading part: each rank attends its layout shard through the ring,
            # which also stores every token's K/V on its owner.
            index = cp.positions(lead, device=q.device)
            qs, ks, vs = (t[:, :lead].index_select(1, index).contiguous() for t in (q, k, v))
            out = prefill_attention(qs, ks, vs, shard, group=cp.group, layout=cp.layout,
                                    **options)
            outs.append(cp.unshard(out))
        if n > lead:
            shard.append(k[:, lead:].contiguous(), v[:, lead:].contiguous())
            outs.append(decode_attention(q[:, lead:].contiguous(), shard, group=cp.group,
                                         **options))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend_chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        options: dict, chunk: int) -> torch.Tensor:
        """attend() for chunked attention (Llama 4) past one chunk: each query sees the keys of
        its chunk only. The prompt (every rank holds all of it) attends locally in chunks, its
        K/V stored on their owners; each later token is a decode over the sharded cache with
        the window back to its chunk's start."""
        past, (batch, n) = self.get_seq_length(), q.shape[:2]
        shard, window = self.shard, options.pop("window")
        timeout = options.pop("timeout")
        if past == 0:
            shard.append(k.contiguous(), v.contiguous())
            out = attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                   chunk_boundaries((n,) * batch, (0,) * batch, chunk),
                                   causal=True, window=window, **options)
            return out.view(batch, n, *out.shape[1:])
        outs = []
        for i in range(n):
            position = past + i
            left = position % chunk if window[0] < 0 else min(position % chunk, window[0])
            shard.append(k[:, i:i + 1].contiguous(), v[:, i:i + 1].contiguous())
            outs.append(decode_attention(q[:, i:i + 1].contiguous(), shard, group=self.cp.group,
                                         window=(left, -1), timeout=timeout, **options))
        return torch.cat(outs, dim=1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.shard is None else int(self.shard.lengths[0])

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        if self.shard is not None:
            self.shard.clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot repeat sequences "
                                  "(num_return_sequences > 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot select sequences")


class ContextParallelCache(Cache):
    """A transformers Cache whose K/V are sharded over cp's ranks (cpattn.KVCacheShard per layer:
    token t lives on rank (t // interleave) % W only).

    Args:
        cp: the ContextParallel settings (its group; strategy "hybrid" is not supported).
        config: the model's config (for the number of layers).
        capacity: the most tokens per sequence (prompt plus generated).
        interleave: tokens per round-robin block of the cache.

    Pass it as `cache=` to `model.generate` (greedy or sampling, batch of equal-length prompts
    without padding) on every rank, with the same inputs on every rank.
    """

    def __init__(self, cp: ContextParallel, config, capacity: int, *, interleave: int = 1):
        if cp.strategy == "hybrid":
            raise ValueError(f"{WHAT}: ContextParallelCache needs a single process group; "
                             "strategy 'hybrid' has two")
        if getattr(config.get_text_config(), "kv_lora_rank", None):
            raise ValueError(
                f"{WHAT}: the {config.model_type!r} model uses multi-head latent attention: it "
                "caches latents and expands them to K/V after the cache, so ContextParallelCache "
                "(a cache of K/V sharded by token) cannot serve it; generate without context "
                "parallelism for this model")
        layers = [_ShardedLayer(cp, capacity, interleave)
                  for _ in range(config.get_text_config().num_hidden_layers)]
        super().__init__(layers=layers)
        self.cp = cp

