// The op schemas of the public library torch.ops.cpattn, in one place. Each backend registers
// its implementations for its dispatch key (csrc/ops/attention_cpu.cpp, attention_cuda.cpp); the
// ops without a tensor argument are CompositeExplicitAutograd where they are defined. Test- and
// benchmark-only ops: the library cpattn_testing (csrc/ops/testing_ops.cpp, built apart).
#include <torch/library.h>

#include "ops/options.h"

TORCH_LIBRARY(cpattn, m) {
  // Every attention op ends with the attention options (ops/options.h kOptionsSchema);
  // with_options appends them. They are not keyword-only in the schema (no `*`): Python passes
  // them by name (AttentionOptions.op_kwargs), the dispatcher may pass them positionally.
  using cpattn::ops::with_options;
  // The ops that talk to peers over cpattn's NCCL ring cannot be captured in a CUDA graph (its
  // watchdog queries events, and a captured send/recv would replay without it): tagged, so that
  // torch.compile's cudagraphs (mode="reduce-overhead") leave them out; a capture raises.
  const std::vector<at::Tag> talks_to_peers{at::Tag::cudagraph_unsafe};
  // Local attention. Query row i / key j sit at global positions q_offset + i / k_offset + j;
  // without offsets (cpattn.attention), bottom-right aligned: q_offset = seqlen_k - seqlen_q.
  m.def(with_options(
      "attention_fwd(Tensor q, Tensor k, Tensor v, int? q_offset=None, int? k_offset=None, "
      "ScalarType? out_dtype=None, Tensor? sinks=None",
      "(Tensor out, Tensor lse)"));
  m.def(with_options(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? out, Tensor lse, "
      "int? q_offset=None, int? k_offset=None, ScalarType? grad_dtype=None, Tensor? dlse=None, "
      "Tensor? row_dot=None",
      "(Tensor dq, Tensor dk, Tensor dv)"));
  // attention_bwd (grad_dtype: q's) with dq written over dout, for a caller that owns dout and
  // needs it no more (Ulysses' dout by heads): one (B, S, H, D) buffer less. dout must have q's
  // shape and dtype and must not overlap q, k or v; dq is dout afterwards.
  m.def(with_options(
      "attention_bwd_in_dout(Tensor(a!) dout, Tensor q, Tensor k, Tensor v, Tensor? out, "
      "Tensor lse, int? q_offset=None, int? k_offset=None, Tensor? dlse=None, "
      "Tensor? row_dot=None",
      "(Tensor dk, Tensor dv)"));
  // Attention sinks (softmax_state.h add_sink): added once to merged results, and their gradient.
  m.def("apply_sinks_(Tensor(a!) out, Tensor(b!) lse, Tensor sinks) -> ()");
  m.def("sink_bwd(Tensor dout, Tensor out, Tensor lse, Tensor sinks, Tensor? dlse=None) -> Tensor");
  // rowsum(a * b) over head_dim of (B, S, H, D) tensors: (B, H, S) float32 (attention_bwd's
  // row_dot for a caller holding out in another layout).
  m.def("row_dot(Tensor a, Tensor b) -> Tensor");
  m.def("merge_state_(Tensor(a!) out, Tensor(b!) lse, Tensor part_out, Tensor part_lse) -> ()");
  // Ring attention over the process group registered as group_name; layout: 0 contiguous,
  // 1 zigzag, 2 striped. doc_lengths: (D,) packed documents' lengths; doc_prefix_lens: (D,) each
  // document's prefix-LM length (a prefix per document), or none.
  m.def(with_options(
            "ring_fwd(Tensor q, Tensor k, Tensor v, str group_name, int layout, float timeout_s, "
            "Tensor? doc_lengths=None, "
            "Tensor? doc_prefix_lens=None, Tensor? sinks=None",
            "(Tensor out, Tensor lse)"),
        talks_to_peers);
  m.def(with_options("ring_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                     "str group_name, "
                     "int layout, float timeout_s, Tensor? doc_lengths=None, "
                     "Tensor? doc_prefix_lens=None, Tensor? dlse=None",
                     "(Tensor dq, Tensor dk, Tensor dv)"),
        talks_to_peers);
  // The same steps against K/V already all-gathered: k_all (W, B, S_local, Hkv, D), v_all
  // (W, B, S_local, Hkv, Dv); the backward's fp32 dK and dV side by side, (W, B, S_local, Hkv,
  // D + Dv), for one reduce-scatter.
  m.def(
      with_options("gathered_fwd(Tensor q, Tensor k_all, Tensor v_all, int rank, int layout, "
                   "Tensor? doc_lengths=None, "
                   "Tensor? doc_prefix_lens=None, Tensor? sinks=None",
                   "(Tensor out, Tensor lse)"));
  m.def(with_options(
      "gathered_bwd(Tensor dout, Tensor q, Tensor k_all, Tensor v_all, Tensor out, Tensor lse, "
      "int rank, int layout, Tensor? doc_lengths=None, "
      "Tensor? doc_prefix_lens=None, Tensor? dlse=None",
      "(Tensor dq, Tensor dkv_all)"));
  // Local attention over packed documents (cpattn.attention_varlen): q (1, T, H, D), k, v
  // (1, T, Hkv, D | Dv), doc_lengths and doc_prefix_lens as the ring ops' (the documents' lengths
  // summing to T; their prefixes, or none); no communication.
  m.def(
      with_options("attention_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor doc_lengths, "
                   "Tensor? doc_prefix_lens=None, Tensor? sinks=None",
                   "(Tensor out, Tensor lse)"));
  m.def(with_options(
      "attention_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor doc_lengths, Tensor? doc_prefix_lens=None, Tensor? dlse=None",
      "(Tensor dq, Tensor dk, Tensor dv)"));
  // Invariant mode (ops/invariant.cpp): what one process computes for this rank's rows and keys.
  // The forward from k, v of every rank in global order; the backward of one process, or over W
  // ranks streamed into fp32 running sums, a part of every rank's tokens at a time; the sinks'
  // gradient from every rank's lse and dlse - row_dot.
  m.def(with_options(
      "invariant_fwd(Tensor q, Tensor k, Tensor v, int rank, int world, int layout, int seqlen, "
      "Tensor? doc_lengths=None, "
      "Tensor? doc_prefix_lens=None, Tensor? sinks=None",
      "(Tensor out, Tensor lse)"));
  m.def(with_options(
      "invariant_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? dlse, Tensor? sinks, int layout, int seqlen, Tensor? doc_lengths=None, "
      "Tensor? doc_prefix_lens=None",
      "(Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)"));
  m.def(with_options(
      "invariant_bwd_part(Tensor(a!) dq_sum, Tensor(b!) dk_sum, Tensor(c!) dv_sum, Tensor dout, "
      "Tensor q, Tensor k, Tensor v, Tensor lse, Tensor shifted, Tensor dout_part, "
      "Tensor q_part, Tensor k_part, Tensor v_part, Tensor lse_part, Tensor shifted_part, "
      "int part_begin, int rank, int world, int layout, int seqlen, Tensor? doc_lengths=None, "
      "Tensor? doc_prefix_lens=None",
      "()"));
  m.def(with_options(
      "invariant_bwd_rows(Tensor(a!) dq_sum, Tensor(b!) planes, Tensor dout, Tensor q, "
      "Tensor k_part, Tensor v_part, Tensor lse, Tensor shifted, int[] bands, int part_begin, "
      "int rank, int world, int layout, int seqlen, Tensor? doc_lengths=None, "
      "Tensor? doc_prefix_lens=None",
      "()"));
  m.def(with_options(
      "invariant_bands_seen(int local, int part_begin, int n, int world, int layout, int seqlen, "
      "Tensor? doc_lengths=None, Tensor? doc_prefix_lens=None",
      "Tensor"));
  m.def(
      "invariant_sink_bwd(Tensor lse_all, Tensor shifted_all, Tensor sinks, int rank, int world, "
      "int layout, int seqlen, Tensor? doc_lengths=None) -> Tensor");
  // Invariant mode over a KV cache: the keys per tile (cpattn/invariant.h), one block of tiles'
  // partial result, the blocks' tree merge.
  m.def("invariant_tile() -> int");
  m.def("invariant_row_band() -> int");  // the streamed backward's parts start at its multiples
  m.def(with_options("invariant_partial(Tensor q, Tensor k, Tensor v, int q_begin, int k_begin",
                     "(Tensor out, Tensor lse)"));
  m.def(
      "invariant_merge(Tensor outs, Tensor lses, int[] tiles, Tensor? sinks=None, "
      "ScalarType? out_dtype=None) -> (Tensor out, Tensor lse)");
  m.def("layout_positions(int seqlen, int world, int rank, int layout) -> Tensor");
  // Packed documents as ring_attention_varlen shards them (cpattn/layout.h document_shard):
  // (D, 3) int64, per document its padded length, where it starts in the padded packed sequence
  // and where its part starts in every rank's shard.
  m.def("document_shards(int[] lengths, int world, int layout) -> Tensor");
  // The cost model's view of the schedule: (world, world, 3) work per (rank, step).
  m.def(
      "schedule_work(int seqlen, int world, int layout, bool causal, int window_left, "
      "int window_right, int block_m, int block_n, Tensor? doc_lengths=None) -> Tensor");
  // The cost model's view of the CPU backward: [KV heads per kernel call, key splits, query rows
  // per band] for a shape, dtype and gradient dtype.
  m.def(
      "cpu_backward_sizes(int batch, int seqlen_q, int seqlen_k, int heads, int kv_heads, "
      "int head_dim, ScalarType input_dtype, ScalarType grad_dtype) -> int[]");
  // ... and the bytes of the buffers one such kernel call allocates beyond its tensors (the
  // packed band of query rows, the dQ per key split, the dK / dV sums), all threads together.
  m.def(
      "cpu_backward_buffer_bytes(int batch, int seqlen_q, int seqlen_k, int heads, int kv_heads, "
      "int head_dim, ScalarType input_dtype, ScalarType grad_dtype) -> int");
  // The cost model's count of visible keys per query of a document (cpattn/mask.h).
  m.def(
      "visible_keys(Tensor positions, int num_keys, bool causal, int window_left, "
      "int window_right, int prefix_len) -> Tensor");
  // ... and the keys each query sees, (N, 3) [first, last, prefix_end] (the max-logits pass).
  m.def(
      "visible_key_ranges(Tensor positions, bool causal, int window_left, int window_right, "
      "int prefix_len) -> Tensor");
  m.def("ring_stats() -> Tensor");
  m.def("destroy_communicators() -> int");
  m.def("release_buffers() -> int");
  // The shortest timeout (seconds) of a process group's backends; 0 where none can be read.
  m.def("group_timeout(str group_name) -> float");
  // Inference over a KV cache sharded across ranks (ops/inference.h).
  m.def(
      "merge_attention_states(Tensor outs, Tensor lses, ScalarType? out_dtype=None) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "merge_attention_states_bwd(Tensor dout, Tensor? dlse, Tensor outs, Tensor lses, "
      "Tensor lse) -> (Tensor douts, Tensor dlses)");
  m.def(
      "cache_store_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor start, "
      "int rank, int world, int interleave) -> ()");
  m.def(with_options(
      "cache_attention_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, "
      "Tensor q_start, int rank, int world, int interleave, ScalarType? out_dtype=None",
      "(Tensor out, Tensor lse)"));
  m.def(with_options(
            "prefill_fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor cache_lens, str group_name, int layout, int interleave, float timeout_s, "
            "int seqlen=0",
            "(Tensor out, Tensor lse)"),
        talks_to_peers);
  m.def("cache_local_count(int n, int rank, int world, int interleave) -> int");
  m.def("cache_positions(int n, int rank, int world, int interleave) -> Tensor");
}
