// The ring schedule's work per (rank, step), for the cost model in python/cpattn/plan.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include "cpattn/layout.h"
#include "cpattn/work.h"

namespace cpattn::ops {
namespace {

// (world, world, 3) int64: for each (rank, step) of the ring schedule, the visible pairs, the pairs
// in visited block_m x block_n tiles and the kernel calls (csrc/include/cpattn/work.h); per head
// and batch row. doc_lengths: packed documents (varlen) instead of one sequence of seqlen.
at::Tensor schedule_work(int64_t seqlen, int64_t world, int64_t layout, bool causal,
                         int64_t window_left, int64_t window_right, int64_t block_m,
                         int64_t block_n, const std::optional<at::Tensor>& doc_lengths) {
  TORCH_CHECK(layout >= 0 && layout <= 2, "cpattn.schedule_work: layout code must be 0, 1 or 2, "
              "got ", layout);
  TORCH_CHECK(world >= 1, "cpattn.schedule_work: world must be >= 1, got ", world);
  TORCH_CHECK(block_m >= 1 && block_n >= 1, "cpattn.schedule_work: block sizes must be >= 1, "
              "got ", block_m, " x ", block_n);
  TORCH_CHECK(window_left >= -1 && window_right >= -1, "cpattn.schedule_work: window must be "
              ">= -1, got (", window_left, ", ", window_right, ")");
  const Layout l = static_cast<Layout>(layout);
  std::vector<int64_t> docs;
  if (doc_lengths && doc_lengths->defined()) {
    const at::Tensor t = doc_lengths->to(at::kLong).cpu().contiguous();
    docs.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
    for (int64_t n : docs)
      TORCH_CHECK(n >= 0, "cpattn.schedule_work: document lengths must be >= 0, got ", n);
  } else {
    TORCH_CHECK(seqlen > 0 && seqlen % layout_granularity(l, world) == 0,
                "cpattn.schedule_work: seqlen (", seqlen, ") must be a positive multiple of ",
                layout_granularity(l, world), " for this layout over ", world, " ranks");
  }
  Mask global;
  global.causal = causal;
  global.window_left = window_left;
  global.window_right = window_right;
  at::Tensor out = at::zeros({world, world, 3}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t rank = 0; rank < world; ++rank)
    for (int64_t step = 0; step < world; ++step) {
      const Work w = step_work(l, seqlen, docs.data(), static_cast<int64_t>(docs.size()), world,
                               rank, step, global, static_cast<int>(block_m),
                               static_cast<int>(block_n));
      int64_t* cell = p + (rank * world + step) * 3;
      cell[0] = w.pairs;
      cell[1] = w.tile_pairs;
      cell[2] = w.calls;
    }
  return out;
}

}  // namespace
}  // namespace cpattn::ops

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("schedule_work", &cpattn::ops::schedule_work);
}
