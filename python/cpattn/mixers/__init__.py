"""Token mixers outside attention (short convolutions, Mamba, the delta rules, lightning
attention), exact on the tokens cpattn shards: the piece map (`pieces`), the two primitives
(`primitives.causal_conv` with its halo, `primitives.state_scan`), the exchange they share
(`exchange`), the local recurrences (`kernels`) and a prefill that starts from and hands off a
cached state, for generation (`handoff`). docs/hybrid-models.md explains the method."""

from cpattn.mixers.exchange import Exchange, group_exchange, stacked
from cpattn.mixers.pieces import Piece, PieceMap, build_piece_map
from cpattn.mixers.primitives import causal_conv, compose, conv_halo, state_scan

__all__ = ["Exchange", "Piece", "PieceMap", "build_piece_map", "causal_conv", "compose",
           "conv_halo", "group_exchange", "stacked", "state_scan"]
