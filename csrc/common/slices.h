#pragma once
// Index math of the multi-tensor slice ops (slice_gather / slice_scatter_), written once for the
// CPU kernels (csrc/cpu/slices.cpp), the CUDA kernels (csrc/cuda/slices.cu) and the host-side plan
// builder (csrc/slices_plan.h).
//
// A tensor sliced along `dim` is viewed row-major as [outer, size, inner] (outer = prod(shape[:dim]),
// size = shape[dim], inner = prod(shape[dim+1:])). A segment holds n of its slices (an index list
// idx[0..n)) as a compact row-major tensor [outer, n, inner]: element (o, k, c) of the segment is
// element (o, idx[k], c) of the full tensor. A row is one (o, k) pair: `inner` contiguous elements
// in both the segment and the full tensor.
//
// Scatter owners: pos_j[i] = k if segment j holds slice i at position k, else -1 (the inverse map
// of idx_j). The owners of an element of slice i of a target are the segments j of that target with
// pos_j[i] >= 0, visited in segment order, so every reduction is deterministic (no atomics).
#include <cstdint>

#include "common/macros.h"

namespace ist {

// ---- [outer, size, inner] view of a tensor sliced along one dim
struct SliceView {
  int64_t outer, size, inner;
};

IST_HD SliceView slice_view(const int64_t* shape, int64_t ndim, int64_t dim) {
  SliceView v{1, shape[dim], 1};
  for (int64_t d = 0; d < dim; ++d) v.outer *= shape[d];
  for (int64_t d = dim + 1; d < ndim; ++d) v.inner *= shape[d];
  return v;
}

// Elements of the compact segment holding n slices: outer * n * inner.
IST_HD int64_t segment_numel(const SliceView& v, int64_t n) { return v.outer * n * v.inner; }

// Offset of element (o, i, c) in the full tensor, and of element (o, k, c) in a segment of n slices.
IST_HD int64_t full_offset(const SliceView& v, int64_t o, int64_t i, int64_t c) { return (o * v.size + i) * v.inner + c; }
IST_HD int64_t segment_offset(const SliceView& v, int64_t n, int64_t o, int64_t k, int64_t c) {
  return (o * n + k) * v.inner + c;
}

// ---- Division by a run-time invariant divisor d (1 <= d, n < 2^31), as used for element
// decomposition in the CUDA kernels: q = (umulhi(n, magic) + n) >> shift (Granlund-Montgomery,
// the same scheme as PyTorch's IntDivider). Host code builds it; both sides can evaluate it.
struct FastDiv {
  uint32_t divisor, magic, shift;
};

inline FastDiv make_fast_div(uint32_t d) {  // host only
  uint32_t shift = 0;
  while (shift < 32 && (uint64_t{1} << shift) < d) ++shift;
  const uint64_t magic = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1;
  return FastDiv{d, static_cast<uint32_t>(magic), shift};
}

IST_HD uint32_t fast_div(const FastDiv& f, uint32_t n) {
#if defined(__CUDA_ARCH__)
  const uint32_t t = __umulhi(n, f.magic);
#else
  const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(n) * f.magic) >> 32);
#endif
  return (t + n) >> f.shift;
}

// Largest number a FastDiv may divide (and divisor it may hold).
constexpr int64_t kFastDivMax = (int64_t{1} << 31) - 1;

// ---- Segment lookup: the segment holding flat position e, given the ascending start positions
// starts[0..count) (starts[0] == 0): the largest j with starts[j] <= e.
IST_HD int64_t find_segment(const int64_t* starts, int64_t count, int64_t e) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (starts[mid] <= e) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---- Inverse map of an index list: pos[idx[k]] = k; pos must hold -1 everywhere beforehand.
IST_HD void fill_inverse_map(const int64_t* idx, int64_t n, int32_t* pos) {
  for (int64_t k = 0; k < n; ++k) pos[idx[k]] = static_cast<int32_t>(k);
}

// ---- Reduction over the owners of one element, in segment order.
//   copy: the last owner's value.
//   sum:  ((target + u_1) + u_2) + ... + u_k, accumulated in acc_t.
//   mean: OwnerMean below.
// Owner counts k come from the index lists (the number of owners visited), never from the data.
enum class SliceReduce : int { Copy = 0, Sum = 1, Mean = 2 };

// Mean of the k owners u_1..u_k of one element, fed in segment order, accumulated in acc_t (float
// for half/bfloat16, int64 for integers) and rounded once by the caller.
//   floating: u_1 + (sum_{l>=2} (u_l - u_1)) / k, and exactly u_1 when that sum is 0, so owners
//     that all return the same value give that value bit for bit (aggregating unchanged
//     subnetworks is the identity). Where that form overflows (owners of opposite sign near the
//     largest finite value, or an infinite owner, whose deviations are inf/nan), the mean is
//     (sum_l u_l * 2^-64) / k * 2^64 instead, which cannot overflow: [inf, 3e38] -> inf,
//     [3e38, -3e38] -> 0, [inf, -inf] -> nan, as the exact mean.
//   integral: (u_1 + ... + u_k) / k, rounded toward zero.
template <typename acc_t, bool Integral>
struct OwnerMean {
  acc_t first, dev, scaled;  // set by begin()

  static IST_HD acc_t down() { return acc_t(5.42101086242752217e-20); }  // 2^-64, exact in float
  static IST_HD acc_t up() { return acc_t(1.8446744073709551616e19); }   // 2^64
  static IST_HD bool finite(acc_t v) { return v - v == acc_t(0); }       // false for inf and nan

  IST_HD void begin(acc_t u1) {
    first = u1;
    if constexpr (Integral) {
      dev = u1;
      scaled = acc_t(0);
    } else {
      dev = acc_t(0);
      scaled = u1 * down();
    }
  }
  IST_HD void step(acc_t u) {
    if constexpr (Integral) {
      dev += u;
    } else {
      dev += u - first;
      scaled += u * down();
    }
  }
  IST_HD acc_t finish(int64_t k) const {
    if constexpr (Integral) {
      return dev / static_cast<acc_t>(k);
    } else {
      if (dev == acc_t(0)) return first;
      const acc_t m = first + dev / static_cast<acc_t>(k);
      return finite(dev) && finite(m) ? m : scaled / static_cast<acc_t>(k) * up();
    }
  }
};

}  // namespace ist
