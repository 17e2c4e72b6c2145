"""cpattn: context-parallel exact attention for PyTorch.

Layout everywhere: q, k, v and out are (batch, seqlen, heads, head_dim); LSE is float32 natural
log, (batch, heads, seqlen). See docs/design.md for the conventions.
"""

from cpattn.core.loader import load_extension as _load_extension

_C = _load_extension()

# _ops registers the fake kernels and autograd of the ops; memory: allocator byte counts, the
# ring's cached buffers; plan: the cost model behind strategy="auto"
from cpattn import comm, memory, plan  # noqa: E402,F401
from cpattn.attention import attention, attention_varlen, merge_state_  # noqa: E402
from cpattn.context_attention import context_attention  # noqa: E402
from cpattn.core import ops as _ops  # noqa: E402,F401
from cpattn.core.agreement import get_rank_check, set_rank_check  # noqa: E402
from cpattn.core.options import AttentionOptions  # noqa: E402
from cpattn.inference.attention import (  # noqa: E402
    KVCacheShard,
    chunk_positions,
    decode_attention,
    merge_attention_states,
    prefill_attention,
)
from cpattn.memory import release_buffers  # noqa: E402
from cpattn.parallel import ContextParallel  # noqa: E402
from cpattn.sharding.documents import DocumentPlan, shard_documents  # noqa: E402
from cpattn.sharding.sequences import (  # noqa: E402
    hybrid_positions,
    hybrid_shard,
    hybrid_unshard,
    pad_documents,
    positions,
    positions_varlen,
    shard,
    shard_varlen,
    unshard,
    unshard_varlen,
)
from cpattn.strategies.hybrid import hybrid_attention, hybrid_attention_varlen  # noqa: E402
from cpattn.strategies.ring import (  # noqa: E402
    destroy_communicators,
    ring_attention,
    ring_attention_varlen,
)
from cpattn.strategies.ulysses import ulysses_attention, ulysses_attention_varlen  # noqa: E402
from cpattn.training import cross_entropy, load_balancing_loss, shard_batch  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "attention",
    "AttentionOptions",
    "merge_state_",
    "ring_attention",
    "destroy_communicators",
    "shard",
    "unshard",
    "positions",
    "ring_attention_varlen",
    "DocumentPlan",
    "shard_documents",
    "shard_varlen",
    "unshard_varlen",
    "positions_varlen",
    "pad_documents",
    "ulysses_attention",
    "ulysses_attention_varlen",
    "attention_varlen",
    "hybrid_attention",
    "hybrid_attention_varlen",
    "hybrid_positions",
    "hybrid_shard",
    "hybrid_unshard",
    "comm",
    "memory",
    "release_buffers",
    "plan",
    "context_attention",
    "build_info",
    "KVCacheShard",
    "prefill_attention",
    "decode_attention",
    "merge_attention_states",
    "chunk_positions",
    "ContextParallel",
    "shard_batch",
    "cross_entropy",
    "load_balancing_loss",
    "set_rank_check",
    "get_rank_check",
]


def build_info() -> dict:
    """How the compiled module was built and what it runs with."""
    from cpattn import _build_info as b

    return {
        "torch_version": b.TORCH_VERSION,
        "with_cuda": b.WITH_CUDA,
        "cuda_arch_list": b.CUDA_ARCH_LIST if b.WITH_CUDA else "",
        "cuda_head_dims": getattr(b, "CUDA_HEAD_DIMS", "") if b.WITH_CUDA else "",
        # the CPU kernels' instruction set, and every one in order of preference with the
        # operand type its kernels take bfloat16 inputs as (csrc/cpu/dispatch.cpp)
        "cpu_isa": _C.cpu_isa(),
        "cpu_isa_paths": [{"name": n, "bfloat16_operands": t} for n, t in _C.cpu_isa_paths()],
        # how the CPU kernels run their matrix products per input dtype (docs/environment.md,
        # CPATTN_CPU_GEMM), and whether oneDNN's bf16 products run on AMX tiles
        "cpu_gemm": {d: _C.cpu_gemm(d) for d in ("float32", "float16", "bfloat16")},
        "cpu_amx": {"cpu": _C.cpu_amx_on_cpu(), "usable": _C.cpu_amx_usable()},
        "nccl_version": _C.nccl_version(),
    }
