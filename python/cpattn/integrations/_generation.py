"""Generation under context parallelism: ContextParallelCache, a transformers Cache whose
attention layers are cpattn KVCacheShards (each token's K/V on one rank only) and whose token-mixer
layers (convolutions, Mamba, delta rules, lightning attention: a parallelized hybrid model's) are
transformers' own LinearAttentionLayer, holding each sequence's conv and recurrent states, the
same on every rank (cpattn.integrations.hybrid.generation fills them)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from cpattn.attention import attention_varlen
from cpattn.core.options import AttentionOptions
from cpattn.inference.attention import decode_attention, prefill_attention
from cpattn.inference.kv_cache import KVCacheShard
from cpattn.integrations._model_checks import WHAT, agree, attention_chunk, check_layer
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import chunk_boundaries

PENDING: dict[int, "ShardedLayer"] = {}  # id(key handed to attention) -> its cache layer
MIXER_TYPES = ("conv", "linear_attention")  # transformers' layer types with conv / recurrent states
BOTH_TYPES = ("hybrid", "hybrid_sliding")  # attention and a mixer in one layer (Falcon-H1, Zamba2)

PADDING = (f"{WHAT}: the model was given an attention_mask with padding (zeros): cpattn cannot "
           "apply a padding mask under context parallelism. Give the padded batch to "
           "cpattn.shard_batch (it unpacks the rows into documents) and pass no attention_mask "
           "to the model; to generate, pass cache=ContextParallelCache(...) with left padding")


class LeftPadding:
    """What cpattn's mask function hands the attention for a left-padded batch: the 2-D mask
    (B, tokens so far), rows of zeros then ones. Only ContextParallelCache's attention reads it;
    anything else that touches it raises the padding refusal."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.__dict__["mask"] = mask

    def real(self, n: int) -> list[int]:
        """Tokens of each row among the last n that are not padding (a suffix of them)."""
        return [int(c) for c in self.mask[:, -n:].sum(1).tolist()]

    def __getattr__(self, name):
        raise ValueError(PADDING)


def left_padded(mask: torch.Tensor) -> bool:
    """Whether a 2-D 0/1 mask is each row's zeros, then its ones."""
    m = mask.to(torch.int64)
    return bool((m[:, 1:] >= m[:, :-1]).all())


def host_padding(cp: ContextParallel, mask: torch.Tensor) -> Optional[LeftPadding]:
    """What cpattn's mask function hands the attention for a padding mask read on the host:
    None when it is all ones, LeftPadding when each row is left-padded (generation honours it,
    anything else raises PADDING); raises ValueError on every rank for any other mask."""
    def all_ones_or_left_padded():
        if mask.dim() != 2:
            raise ValueError(f"{WHAT}: the model was given a {mask.dim()}-D attention mask: "
                             "cpattn applies causality, windows and documents itself and takes "
                             "a 2-D padding mask only (left padding, to generate)")
        if not bool(mask.all()) and not left_padded(mask):
            raise ValueError(PADDING)

    agree(cp, WHAT, all_ones_or_left_padded)
    return None if bool(mask.all()) else LeftPadding(mask)


class ShardedLayer(CacheLayerMixin):
    """One layer's cache: this rank's KVCacheShard. update() does not concatenate: it hands the
    new K/V to the attention function, which stores them in the owners' shards and attends. A
    left-padded batch keeps each row's real tokens only (the row's cache length); `seen` counts
    the positions generate has passed, padding included (what get_seq_length reports)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cp: ContextParallel, capacity: int, interleave: int) -> None:
        super().__init__()
        self.cp, self.capacity, self.interleave = cp, capacity, interleave
        self.shard: Optional[KVCacheShard] = None
        self.pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.seen = 0

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
        PENDING[id(key_states)] = self
        return key_states, value_states

    def attend(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, opts: AttentionOptions,
               padding: Optional[LeftPadding] = None) -> torch.Tensor:
        """q (B, n, H, D), k / v (B, n, Hkv, D): the n new tokens, the same on every rank.
        Stores their K/V in the sharded cache (padding: each row's real tokens only); returns
        their attention output (B, n, H, D), 0 at padding."""
        self.pending = None
        past, n = self.get_seq_length(), q.shape[1]
        # (temperature tuning sees the global positions here; chunks: _attend_chunked)
        check_layer(module, 0, past + n - 1, chunks=True)
        if not opts.causal:
            raise ValueError(f"{WHAT}: ContextParallelCache supports causal attention only (a "
                             "decoder's); got causal=False")
        real = padding.real(n) if padding is not None else [n] * q.shape[0]
        chunk = attention_chunk(module)
        if chunk is not None and past + n > chunk:
            if real != [n] * q.shape[0]:
                raise ValueError(f"{WHAT}: ContextParallelCache runs chunked attention past one "
                                 "chunk on batches without padding only (generate each prompt "
                                 "alone)")
            out = self._attend_chunked(q, k, v, opts, chunk)
        elif real == [n] * q.shape[0]:
            out = self._attend(self.shard, q, k, v, opts)
        else:  # rows of different lengths: each row's real tokens, on its view of the cache
            out = q.new_zeros(q.shape)
            for b, r in enumerate(real):
                if r:
                    out[b:b + 1, n - r:] = self._attend(
                        self.shard.sequences(b, b + 1),
                        *(t[b:b + 1, n - r:] for t in (q, k, v)), opts)
        self.seen += n
        return out

    def _attend(self, shard: KVCacheShard, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                opts: AttentionOptions) -> torch.Tensor:
        """The n tokens of every row of `shard`: the leading multiple of the layout granularity
        through the ring (which stores every token's K/V on its owner), the rest through
        decode_attention."""
        # (causal=True: checked above; prefill and decode are causal)
        options = self.cp.with_mode(opts.as_keywords())
        cp, n = self.cp, q.shape[1]
        lead = n - n % cp.granularity
        outs = []
        if lead:
            index = cp.positions(lead, device=q.device)
            qs, ks, vs = (t[:, :lead].index_select(1, index).contiguous() for t in (q, k, v))
            out = prefill_attention(qs, ks, vs, shard, group=cp.group, layout=cp.layout,
                                    timeout=cp.timeout, **options)
            outs.append(cp.unshard(out))
        if n > lead:
            shard.append(k[:, lead:].contiguous(), v[:, lead:].contiguous())
            outs.append(decode_attention(q[:, lead:].contiguous(), shard, group=cp.group,
                                         timeout=cp.timeout, **options))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend_chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        opts: AttentionOptions, chunk: int) -> torch.Tensor:
        """attend() for chunked attention (Llama 4) past one chunk: each query sees the keys of
        its chunk only. The prompt (every rank holds all of it) attends locally in chunks, its
        K/V stored on their owners; each later token is a decode over the sharded cache with
        the window back to its chunk's start."""
        past, (batch, n) = self.get_seq_length(), q.shape[:2]
        shard, window, cp = self.shard, opts.window, self.cp
        if past == 0:
            shard.append(k.contiguous(), v.contiguous())
            out = attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                   chunk_boundaries((n,) * batch, (0,) * batch, chunk),
                                   **cp.with_mode(opts.as_keywords()))
            return out.view(batch, n, *out.shape[1:])
        outs = []
        for i in range(n):
            position = past + i
            left = position % chunk if window[0] < 0 else min(position % chunk, window[0])
            shard.append(k[:, i:i + 1].contiguous(), v[:, i:i + 1].contiguous())
            outs.append(decode_attention(
                q[:, i:i + 1].contiguous(), shard, group=cp.group, timeout=cp.timeout,
                **cp.with_mode(opts.replace(window=(left, -1)).as_keywords())))
        return torch.cat(outs, dim=1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        if self.shard is not None:
            self.shard.clear()
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot repeat sequences "
                                  "(num_return_sequences > 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot select sequences")


class MixerLayer(LinearAttentionLayer):
    """A token-mixer layer's cache: transformers' own (conv_states, recurrent_states: the
    module's own decode reads them), the same on every rank; `tokens` counts the positions it
    has passed (for a model without attention layers: get_seq_length)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, number_of_states: int = 1, **kwargs) -> None:
        super().__init__(number_of_states=number_of_states)
        self.tokens = 0

    def reset(self) -> None:
        super().reset()
        self.tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot repeat sequences "
                                  "(num_return_sequences > 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{WHAT}: ContextParallelCache cannot select sequences")


class ShardedMixerLayer(MixerLayer, ShardedLayer):
    """A layer with attention and a token mixer side by side (Falcon-H1, Zamba2's hybrid
    layers): a KVCacheShard and the mixer's states."""

    def __init__(self, cp: ContextParallel, capacity: int, interleave: int,
                 number_of_states: int = 1) -> None:
        ShardedLayer.__init__(self, cp, capacity, interleave)
        MixerLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # (update: key_states, value_states)
            ShardedLayer.lazy_initialization(self, *args)
        else:  # (update_conv_state / update_recurrent_state: keywords)
            MixerLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        MixerLayer.reset(self)
        ShardedLayer.reset(self)

    def get_max_length(self) -> int:
        return self.capacity


class ContextParallelCache(Cache):
    """A transformers Cache for generation under context parallelism: the K/V of attention layers
    sharded over cp's ranks (cpattn.KVCacheShard per layer: token t lives on rank
    (t // interleave) % W only); the conv and recurrent states of token-mixer layers (a
    parallelized hybrid model's) replicated, in transformers' own layout, filled by a
    context-parallel prefill (docs/hybrid-models.md#generation).

    Args:
        cp: the ContextParallel settings (its group; strategy "hybrid" is not supported).
        config: the model's config (its layers and their types).
        capacity: the most tokens per sequence (prompt plus generated).
        interleave: tokens per round-robin block of the cache.

    Pass it as `cache=` to `model.generate` (greedy or sampling; prompts of different lengths
    left-padded with their attention_mask; `prefill_chunk_size` for a chunked prefill) on every
    rank, with the same inputs on every rank.
    """

    def __new__(cls, cp: ContextParallel, config, *args, **kwargs):
        if cls is ContextParallelCache and getattr(config, "model_type", None) == "minimax":
            cls = _minimax_cache()  # (MiniMax's model requires its own cache class)
        return super().__new__(cls)

    def __init__(self, cp: ContextParallel, config, capacity: int, *, interleave: int = 1):
        if cp.group is None:  # (the sequence spans several groups: Ulysses x ring)
            raise ValueError(f"{WHAT}: ContextParallelCache needs a single process group; "
                             f"strategy {cp.strategy!r} spans {len(cp.groups)}")
        text = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text)
        if getattr(text, "kv_lora_rank", None) and any(t not in MIXER_TYPES for t in types):
            raise ValueError(
                f"{WHAT}: the {config.model_type!r} model uses multi-head latent attention: it "
                "caches latents and expands them to K/V after the cache, so ContextParallelCache "
                "(a cache of K/V sharded by token) cannot serve it; generate without context "
                "parallelism for this model")
        layers = []
        for kind, extra in zip(types, kwargs):
            states = extra.get("number_of_states", 1)
            if kind in MIXER_TYPES:
                layers.append(MixerLayer(states))
            elif kind in BOTH_TYPES:
                layers.append(ShardedMixerLayer(cp, capacity, interleave, states))
            else:
                layers.append(ShardedLayer(cp, capacity, interleave))
        Cache.__init__(self, layers=layers)
        self.cp = cp

    @property
    def attention_free(self) -> bool:
        """No layer attends (Mamba, or a config of mixers only): the positions passed are the
        mixer layers' count (transformers' Cache would raise)."""
        return not any(isinstance(layer, ShardedLayer) for layer in self.layers)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        if self.attention_free:
            return self.layers[layer_idx or 0].tokens
        return super().get_seq_length(layer_idx)

    def get_query_offset(self, layer_idx: Optional[int] = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: Optional[int]) -> tuple[int, int]:
        if self.attention_free:
            return self.get_seq_length(layer_idx) + query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)


@functools.cache
def _minimax_cache() -> type:
    """ContextParallelCache for MiniMax, whose model accepts only its own cache class
    (MiniMaxCache) and keeps a lightning layer's state through get_linear_cache /
    set_linear_cache: here that state lives in the layer's MixerLayer (recurrent_states[0]),
    like every other mixer's."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class MiniMaxContextParallelCache(ContextParallelCache, MiniMaxCache):
        def get_linear_cache(self, layer_idx: int) -> Optional[torch.Tensor]:
            layer = self.layers[layer_idx]
            if isinstance(layer, MixerLayer) and layer.has_previous_state[0]:
                return layer.recurrent_states[0]
            return None

        def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
            layer = self.layers[layer_idx]
            layer.recurrent_states[0] = linear_cache
            layer.is_recurrent_states_initialized[0] = True
            layer.has_previous_state[0] = True

        def __len__(self) -> int:
            return Cache.__len__(self)

        def batch_repeat_interleave(self, repeats: int) -> None:
            Cache.batch_repeat_interleave(self, repeats)

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            Cache.batch_select_indices(self, indices)

        def crop(self, tokens_to_remove: int) -> None:
            Cache.crop(self, tokens_to_remove)

    return MiniMaxContextParallelCache
