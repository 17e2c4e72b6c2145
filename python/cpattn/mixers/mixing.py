"""What an adapter of a token-mixing module (a model's convolution, Mamba or delta-rule layer)
needs to run it exactly on this rank's tokens: its pieces as rows, the convolution with its halo,
and the entry states from the state scan. Transformers-free."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.mixers.exchange import Exchange
from cpattn.mixers.pieces import PieceMap
from cpattn.mixers.primitives import causal_conv, from_pieces, piece_mask, state_scan, to_pieces


@dataclass(frozen=True)
class Mixing:
    """What an adapter needs: this rank's piece map, its rank and the exchange. Local
    tensors (B, L, ...) become piece rows (B n, longest, ...) and back."""

    piece_map: PieceMap
    rank: int
    exchange: Exchange
    batch: int

    @property
    def pieces(self) -> int:
        return len(self.piece_map.pieces[self.rank])

    @property
    def alone(self) -> bool:
        """No piece of any rank continues a document of another piece: every entry state is
        zero (one process, documents that are all whole), so no summary is needed."""
        return self.piece_map.slots == 0

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return to_pieces(x, self.piece_map, self.rank).flatten(0, 1)

    def local(self, y: torch.Tensor) -> torch.Tensor:
        return from_pieces(y.unflatten(0, (self.batch, self.pieces)), self.piece_map, self.rank)

    def mask(self, device) -> torch.Tensor:
        return piece_mask(self.piece_map, self.rank, device).repeat(self.batch, 1)

    def conv(self, x: torch.Tensor, conv1d: torch.nn.Conv1d) -> torch.Tensor:
        """The module's depthwise causal convolution of x (B, L, C), no activation."""
        return causal_conv(x, conv1d.weight[:, 0], conv1d.bias, self.piece_map, self.rank,
                           self.exchange)

    def entry(self, m: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
        """Entry states (B n, ...) of the piece rows from their summaries (B n, ...)."""
        def unflat(t):
            return t.unflatten(0, (self.batch, self.pieces))
        return state_scan(unflat(m), unflat(s), self.piece_map, self.rank, kind,
                          self.exchange).flatten(0, 1)
