"""Generation under context parallelism: ContextParallelCache, a transformers Cache whose layers
are cpattn KVCacheShards (each token's K/V on one rank only)."""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cpattn.attention import attention_varlen
from cpattn.core.options import AttentionOptions
from cpattn.inference.attention import decode_attention, prefill_attention
from cpattn.inference.kv_cache import KVCacheShard
from cpattn.integrations._model_checks import WHAT, attention_chunk, check_layer
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import chunk_boundaries

PENDING: dict[int, "ShardedLayer"] = {}  # id(key handed to attention) -> its cache layer


class ShardedLayer(CacheLayerMixin):
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
        PENDING[id(key_states)] = self
        return key_states, value_states

    def attend(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, opts: AttentionOptions) -> torch.Tensor:
        """q (B, n, H, D), k / v (B, n, Hkv, D): the n new tokens, the same on every rank.
        Stores their K/V in the sharded cache; returns their attention output (B, n, H, D)."""
        self.pending = None
        past = self.get_seq_length()
        # (temperature tuning sees the global positions here; chunks: _attend_chunked)
        check_layer(module, 0, past + q.shape[1] - 1, chunks=True)
        if not opts.causal:
            raise ValueError(f"{WHAT}: ContextParallelCache supports causal attention only (a "
                             "decoder's); got causal=False")
        chunk = attention_chunk(module)
        if chunk is not None and past + q.shape[1] > chunk:
            return self._attend_chunked(q, k, v, opts, chunk)
        # (causal=True: checked above; prefill and decode are causal)
        options = self.cp.with_mode(opts.as_keywords())
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
        if cp.group is None:  # (the sequence spans several groups: Ulysses x ring)
            raise ValueError(f"{WHAT}: ContextParallelCache needs a single process group; "
                             f"strategy {cp.strategy!r} spans {len(cp.groups)}")
        if getattr(config.get_text_config(), "kv_lora_rank", None):
            raise ValueError(
                f"{WHAT}: the {config.model_type!r} model uses multi-head latent attention: it "
                "caches latents and expands them to K/V after the cache, so ContextParallelCache "
                "(a cache of K/V sharded by token) cannot serve it; generate without context "
                "parallelism for this model")
        layers = [ShardedLayer(cp, capacity, interleave)
                  for _ in range(config.get_text_config().num_hidden_layers)]
        super().__init__(layers=layers)
        self.cp = cp

