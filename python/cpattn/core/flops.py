"""The FLOP count of attention, in flash-attn's convention: the one formula of the benchmarks,
the demos and the cost model (cpattn.plan)."""

# The backward does 2.5x the forward's FLOPs (recomputing the scores, five matmuls to two).
BACKWARD_FLOP_FACTOR = 2.5


def attention_flops(batch: int, heads: int, seqlen_q: float, seqlen_k: float, head_dim: int,
                    causal: bool = False, backward: bool = False) -> float:
    """FLOPs of one attention call: 4 * B * H * Sq * Sk * D forward (two matmuls), halved when
    causal, times BACKWARD_FLOP_FACTOR for the backward."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim / (2 if causal else 1)
    return flops * BACKWARD_FLOP_FACTOR if backward else flops
