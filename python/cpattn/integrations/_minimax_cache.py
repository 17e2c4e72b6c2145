"""ContextParallelCache for MiniMax, whose model accepts only its own cache class (MiniMaxCache)
and keeps a lightning layer's state through get_linear_cache / set_linear_cache: here that state
lives in the layer's MixerLayer (recurrent_states[0]), like every other mixer's."""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from cpattn.integrations._generation import ContextParallelCache, MixerLayer


class MiniMaxContextParallelCache(ContextParallelCache, MiniMaxCache):
    """ContextParallelCache(cp, config, ...) of a MiniMax model (made by ContextParallelCache
    itself for model_type "minimax")."""

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
