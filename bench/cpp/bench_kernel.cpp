// Google Benchmark suite of the CPU attention kernel itself (no torch tensors, no op layer):
// the micro-kernel path (cpattn::cpu::micro_path()) on packed fp32 (B, H, S, Dp) buffers.
//
// Arguments: seqlen, head_dim, causal. Extra flags (after Google Benchmark's own):
//   --heads=N    query heads, batch 1 (default 4; keep it a multiple of the thread count)
//   --threads=N  at::set_num_threads(N) before running (default: torch's default)
// Counter FLOPS uses the flash-attn convention: forward 4 * B * H * S * S * D, halved when
// causal; backward 2.5x forward. Time is wall-clock (UseRealTime) since the kernel is
// parallelised with at::parallel_for; CPU is the process CPU time (all threads).
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/params.h"

namespace {

int64_t g_heads = 4;

constexpr int64_t round_up16(int64_t d) { return (d + 15) / 16 * 16; }

double forward_flops(const cpattn::AttnShape& s, bool causal) {
  const double f = 4.0 * s.batch * s.heads * s.seqlen_q * s.seqlen_k * s.head_dim;
  return causal ? f / 2 : f;
}

// A packed (B, H, S, Dp) operand: random values in [-1, 1) for d < D, zero beyond.
std::vector<float> packed_random(const cpattn::AttnShape& s, int64_t heads, int64_t seqlen,
                                 std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> buf(s.batch * heads * seqlen * s.head_dim_padded, 0.f);
  for (int64_t row = 0; row < s.batch * heads * seqlen; ++row)
    for (int64_t d = 0; d < s.head_dim; ++d) buf[row * s.head_dim_padded + d] = dist(rng);
  return buf;
}

// Inputs and outputs of one problem, with a forward already run (bwd needs its out and lse).
struct Problem {
  cpattn::AttnShape shape;
  bool causal;
  std::vector<float> q, k, v, dout, out, lse, delta, dq, dk, dv;

  Problem(int64_t seqlen, int64_t head_dim, bool causal_) : causal(causal_) {
    shape.batch = 1;
    shape.heads = shape.kv_heads = g_heads;
    shape.seqlen_q = shape.seqlen_k = seqlen;
    shape.head_dim = head_dim;
    shape.head_dim_padded = round_up16(head_dim);
    shape.head_dim_v = head_dim;
    shape.head_dim_v_padded = shape.head_dim_padded;
    std::mt19937 rng(0);
    q = packed_random(shape, shape.heads, seqlen, rng);
    k = packed_random(shape, shape.kv_heads, seqlen, rng);
    v = packed_random(shape, shape.kv_heads, seqlen, rng);
    dout = packed_random(shape, shape.heads, seqlen, rng);
    const int64_t rows = shape.batch * shape.heads * seqlen;
    out.resize(rows * head_dim);
    lse.resize(rows);
    delta.resize(rows);
    dq.resize(rows * head_dim);
    dk.resize(shape.batch * shape.kv_heads * seqlen * head_dim);
    dv.resize(dk.size());
  }

  // out is (B, S, H, D); dk / dv are (B, S, Hkv, D).
  cpattn::BshdStrides bshd_strides(int64_t heads) const {
    return {shape.seqlen_q * heads * shape.head_dim, heads * shape.head_dim, shape.head_dim};
  }
  cpattn::BshdOutput output(std::vector<float>& t, int64_t heads) const {
    return {t.data(), bshd_strides(heads), cpattn::DType::kFloat32};
  }

  // What both passes read: shape, packed q, k, v, the scale and the mask.
  template <typename Params>
  Params inputs() const {
    Params p;
    p.shape = shape;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.softmax_scale = 1.f / std::sqrt(static_cast<float>(shape.head_dim));
    p.mask.causal = causal;
    return p;
  }

  cpattn::FwdParams fwd_params() {
    auto p = inputs<cpattn::FwdParams>();
    p.out = output(out, shape.heads);
    p.lse = lse.data();
    return p;
  }

  cpattn::BwdParams bwd_params() {
    auto p = inputs<cpattn::BwdParams>();
    p.dout = dout.data();
    // the packed (B, H, S, Dp) buffers, as the backward reads operands: by (B, S, H) strides
    const int64_t dp = shape.head_dim_padded, seqlen = shape.seqlen_q;
    p.q_strides = p.dout_strides = {shape.heads * seqlen * dp, dp, seqlen * dp};
    p.k_strides = p.v_strides = {shape.kv_heads * seqlen * dp, dp, seqlen * dp};
    p.lse = lse.data();
    p.delta = delta.data();
    p.dq = output(dq, shape.heads);
    p.dk = output(dk, shape.kv_heads);
    p.dv = output(dv, shape.kv_heads);
    return p;
  }

  // delta[b, h, s] = sum_d dout * out, as the op layer computes it from the forward output.
  void compute_delta() {
    const int64_t S = shape.seqlen_q, H = shape.heads, D = shape.head_dim;
    const int64_t Dp = shape.head_dim_padded;
    for (int64_t b = 0; b < shape.batch; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < S; ++s) {
          const float* o = out.data() + ((b * S + s) * H + h) * D;
          const float* g = dout.data() + ((b * H + h) * S + s) * Dp;
          float acc = 0.f;
          for (int64_t d = 0; d < D; ++d) acc += o[d] * g[d];
          delta[(b * H + h) * S + s] = acc;
        }
  }
};

void set_counters(benchmark::State& state, const Problem& pb, double flops) {
  state.counters["FLOPS"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["heads"] = static_cast<double>(pb.shape.heads);
  state.counters["threads"] = static_cast<double>(at::get_num_threads());
}

void BM_attention_fwd(benchmark::State& state) {
  Problem pb(state.range(0), state.range(1), state.range(2) != 0);
  const cpattn::FwdParams p = pb.fwd_params();
  for (auto _ : state) {
    cpattn::cpu::micro_path().fwd(p);
    benchmark::DoNotOptimize(pb.out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, pb, forward_flops(pb.shape, pb.causal));
}

void BM_attention_bwd(benchmark::State& state) {
  Problem pb(state.range(0), state.range(1), state.range(2) != 0);
  cpattn::cpu::micro_path().fwd(pb.fwd_params());
  pb.compute_delta();
  const cpattn::BwdParams p = pb.bwd_params();
  for (auto _ : state) {
    cpattn::cpu::micro_path().bwd(p);  // writes dq, dk and dv in full
    benchmark::DoNotOptimize(pb.dq.data());
    benchmark::DoNotOptimize(pb.dk.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, pb, 2.5 * forward_flops(pb.shape, pb.causal));
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seqlen", "head_dim", "causal"})
      ->ArgsProduct({{1024, 2048, 4096}, {64, 128}, {0, 1}})
      ->UseRealTime()
      ->MeasureProcessCPUTime()  // CPU column: all threads, so CPU / Time ~ busy cores
      ->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_attention_fwd)->Apply(shapes);
BENCHMARK(BM_attention_bwd)->Apply(shapes);

// Parses --name=N (an int > 0) out of argv; returns true if argv[i] was that flag.
bool parse_int_flag(const char* arg, const char* name, int64_t* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  const long long parsed = std::atoll(arg + n + 1);
  if (parsed <= 0) {
    std::fprintf(stderr, "bench_kernel: %s must be a positive integer, got '%s'\n", name,
                 arg + n + 1);
    std::exit(2);
  }
  *value = parsed;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  int64_t threads = 0;
  for (int i = 1; i < argc; ++i) {
    if (parse_int_flag(argv[i], "--heads", &g_heads) ||
        parse_int_flag(argv[i], "--threads", &threads))
      continue;
    std::fprintf(stderr,
                 "bench_kernel: unknown argument '%s' (own flags: --heads=N, --threads=N; see "
                 "--help for Google Benchmark's)\n",
                 argv[i]);
    return 2;
  }
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  benchmark::AddCustomContext("cpattn_isa", cpattn::cpu::active_isa());
  benchmark::AddCustomContext("torch_threads", std::to_string(at::get_num_threads()));
  benchmark::AddCustomContext("heads", std::to_string(g_heads));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
