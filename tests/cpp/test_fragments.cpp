// The mma.m16n8k16 / ldmatrix vocabulary of the CUDA kernels, replayed on the host: ldmatrix and
// mma are simulated from the PTX ISA's fragment tables, fed by the kernels' own lane offsets
// (csrc/cuda/fragments.h), in the loop shapes the kernels use. Catches a swapped lane bit or
// register order without a GPU.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <random>
#include <vector>

#include "cuda/fragments.h"

namespace cpattn::cuda {
namespace {

using Pair = std::array<float, 2>;  // one 32-bit register of two 16-bit elements (lo, hi)
using Regs4 = std::array<std::array<Pair, 4>, 32>;   // per lane, four registers
using Accum = std::array<std::array<float, 4>, 32>;  // per lane, one 16x8 fp32 C fragment

// ldmatrix.x4 (.trans): lanes 8i..8i+7 address the rows of matrix i.
Regs4 ldmatrix_x4(const std::vector<float>& smem, const std::array<int, 32>& row_offset,
                  bool trans) {
  Regs4 r;
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) {
      if (!trans) {
        const int row = row_offset[8 * i + l / 4];
        r[l][i] = {smem[row + 2 * (l % 4)], smem[row + 2 * (l % 4) + 1]};
      } else {
        r[l][i] = {smem[row_offset[8 * i + 2 * (l % 4)] + l / 4],
                   smem[row_offset[8 * i + 2 * (l % 4) + 1] + l / 4]};
      }
    }
  return r;
}

// d += A B for one m16n8k16 tile, fragments as in the PTX ISA (g = lane / 4, t = lane % 4).
void mma(Accum& d, const Regs4& a, int b_reg0, const Regs4& b, int b_reg1) {
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = a[l][0][e];
      A[g + 8][2 * t + e] = a[l][1][e];
      A[g][2 * t + 8 + e] = a[l][2][e];
      A[g + 8][2 * t + 8 + e] = a[l][3][e];
      B[2 * t + e][g] = b[l][b_reg0][e];
      B[2 * t + 8 + e][g] = b[l][b_reg1][e];
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
      float acc = 0.f;
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      d[l][e] += acc;
    }
  }
}

// C fragment element (lane, e) of an n8 tile -> (row, col) in the 16x8 tile.
int c_row(int lane, int e) { return lane / 4 + 8 * (e >> 1); }
int c_col(int lane, int e) { return 2 * (lane % 4) + (e & 1); }

template <int kStride, typename F>
std::array<int, 32> offsets(F f) {
  std::array<int, 32> o;
  for (int l = 0; l < 32; ++l) o[l] = f(l);
  return o;
}

constexpr int kD = 32;           // head dim
constexpr int kStride = kD + 8;  // padded shared rows, as the kernels
constexpr int kRows = 32;        // query tile rows (the warp takes rows 16..31)
constexpr int kKeys = 32;        // key tile rows
constexpr int kR0 = 16;

std::vector<float> random_tile(int rows, int stride, std::mt19937& rng) {
  std::normal_distribution<float> n;
  std::vector<float> t(rows * stride, NAN);  // the padding is never read
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < stride - 8; ++c) t[r * stride + c] = n(rng);
  return t;
}

// S = Q K^T for the warp's 16 rows (the forward's and the dQ pass's first product; the dK/dV
// pass runs it as K Q^T with the same helpers).
std::array<Accum, kKeys / 8> scores(const std::vector<float>& q, const std::vector<float>& k) {
  std::array<Accum, kKeys / 8> s{};
  for (int ks = 0; ks < kD / 16; ++ks) {
    const Regs4 a = ldmatrix_x4(
        q, offsets<kStride>([&](int l) { return a_offset<kStride>(kR0, ks * 16, l); }), false);
    for (int np = 0; np < kKeys / 16; ++np) {
      const Regs4 bk = ldmatrix_x4(
          k, offsets<kStride>([&](int l) { return bt_offset<kStride>(np * 16, ks * 16, l); }),
          false);
      mma(s[2 * np], a, 0, bk, 1);
      mma(s[2 * np + 1], a, 2, bk, 3);
    }
  }
  return s;
}

TEST(Fragments, QKTranspose) {
  std::mt19937 rng(1);
  const auto q = random_tile(kRows, kStride, rng), k = random_tile(kKeys, kStride, rng);
  const auto s = scores(q, k);
  for (int nt = 0; nt < kKeys / 8; ++nt)
    for (int l = 0; l < 32; ++l)
      for (int e = 0; e < 4; ++e) {
        const int row = kR0 + c_row(l, e), key = nt * 8 + c_col(l, e);
        float ref = 0.f;
        for (int d = 0; d < kD; ++d) ref += q[row * kStride + d] * k[key * kStride + d];
        ASSERT_NEAR(s[nt][l][e], ref, 1e-4f) << "tile " << nt << " lane " << l << " e " << e;
      }
}

// O = P V with P taken from the score registers (c_to_a) and V through ldmatrix .trans; the same
// shape as dV += P^T dO and dK += dS^T Q in the dK/dV pass and dQ += dS K in the dQ pass.
TEST(Fragments, ScoresTimesValues) {
  std::mt19937 rng(2);
  const auto q = random_tile(kRows, kStride, rng), k = random_tile(kKeys, kStride, rng);
  const auto v = random_tile(kKeys, kStride, rng);
  const auto s = scores(q, k);
  std::array<Accum, kD / 8> o{};
  for (int ps = 0; ps < kKeys / 16; ++ps) {
    Regs4 a;
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) {
        const Accum& c = s[2 * ps + kCToATile[i]];
        a[l][i] = {c[l][kCToAElem[i]], c[l][kCToAElem[i] + 1]};
      }
    for (int dp = 0; dp < kD / 16; ++dp) {
      const Regs4 bv = ldmatrix_x4(
          v, offsets<kStride>([&](int l) { return b_trans_offset<kStride>(ps * 16, dp * 16, l); }),
          true);
      mma(o[2 * dp], a, 0, bv, 1);
      mma(o[2 * dp + 1], a, 2, bv, 3);
    }
  }
  for (int dt = 0; dt < kD / 8; ++dt)
    for (int l = 0; l < 32; ++l)
      for (int e = 0; e < 4; ++e) {
        const int row = kR0 + c_row(l, e), d = dt * 8 + c_col(l, e);
        double ref = 0.0;
        for (int key = 0; key < kKeys; ++key) {
          double sc = 0.0;
          for (int j = 0; j < kD; ++j) sc += q[row * kStride + j] * k[key * kStride + j];
          ref += sc * v[key * kStride + d];
        }
        ASSERT_NEAR(o[dt][l][e], ref, 1e-3 * (1.0 + std::fabs(ref)))
            << "dt " << dt << " lane " << l;
      }
}

// dQ = dS K with dS read from the shared dS^T tile [key][query] through ldmatrix .trans
// (a_trans_offset), K through b_trans_offset, as the atomic dQ part of the dK/dV pass.
TEST(Fragments, TransposedAOperand) {
  std::mt19937 rng(3);
  constexpr int kQ = 32, kDSStride = kQ + 8;  // dS^T: kKeys rows of kQ queries
  const auto ds_t = random_tile(kKeys, kDSStride, rng);
  const auto k = random_tile(kKeys, kStride, rng);
  constexpr int r0 = 16, c0 = 16;  // the unit: queries r0..r0+15, head-dim columns c0..c0+15
  std::array<Accum, 2> acc{};
  for (int ns = 0; ns < kKeys / 16; ++ns) {
    const Regs4 a = ldmatrix_x4(
        ds_t, offsets<kDSStride>([&](int l) { return a_trans_offset<kDSStride>(r0, ns * 16, l); }),
        true);
    const Regs4 bk = ldmatrix_x4(
        k, offsets<kStride>([&](int l) { return b_trans_offset<kStride>(ns * 16, c0, l); }), true);
    mma(acc[0], a, 0, bk, 1);
    mma(acc[1], a, 2, bk, 3);
  }
  for (int j = 0; j < 2; ++j)
    for (int l = 0; l < 32; ++l)
      for (int e = 0; e < 4; ++e) {
        const int row = r0 + c_row(l, e), d = c0 + j * 8 + c_col(l, e);
        float ref = 0.f;
        for (int key = 0; key < kKeys; ++key)
          ref += ds_t[key * kDSStride + row] * k[key * kStride + d];
        ASSERT_NEAR(acc[j][l][e], ref, 1e-4f) << "j " << j << " lane " << l << " e " << e;
      }
}

// Every lane's 16-byte row address is 16-byte aligned, and the 8 rows of one ldmatrix matrix
// fall in 8 distinct 16-byte bank groups (the padded stride: no bank conflicts).
TEST(Fragments, AlignedConflictFreeRows) {
  for (int lane = 0; lane < 32; ++lane) {
    EXPECT_EQ(a_offset<kStride>(0, 16, lane) % 8, 0);
    EXPECT_EQ(bt_offset<kStride>(16, 0, lane) % 8, 0);
  }
  for (int m = 0; m < 4; ++m) {
    std::array<bool, 8> used{};
    for (int j = 0; j < 8; ++j) {
      const int bytes = 2 * a_offset<64 + 8>(0, 0, 8 * m + j);
      const int group = (bytes / 16) % 8;
      EXPECT_FALSE(used[group]) << "matrix " << m << " row " << j;
      used[group] = true;
    }
  }
}

}  // namespace
}  // namespace cpattn::cuda
