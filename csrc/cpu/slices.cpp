// CPU kernels for slice_gather / slice_scatter_ (multi-tensor slices: LOFT, ResIST, IST partitions).
// Work is split into rows (one (outer, slice) pair: `inner` contiguous elements) across all
// tensors of the call, and the rows are shared among threads by one parallel_for per op.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "common/slices.h"
#include "slices_plan.h"

namespace ist::cpu {
namespace {

// Rows per parallel task: enough bytes that a task amortises its start.
int64_t row_grain(int64_t bytes, int64_t rows) {
  const int64_t per_row = rows > 0 ? std::max<int64_t>(1, bytes / rows) : 1;
  return std::max<int64_t>(1, (int64_t{1} << 16) / per_row);
}

// Copy one row of `bytes` bytes; fixed-size copies for the short rows of slicing along the last dim.
inline void copy_row(char* dst, const char* src, int64_t bytes) {
  switch (bytes) {
    case 1: std::memcpy(dst, src, 1); return;
    case 2: std::memcpy(dst, src, 2); return;
    case 4: std::memcpy(dst, src, 4); return;
    case 8: std::memcpy(dst, src, 8); return;
    case 16: std::memcpy(dst, src, 16); return;
    default: std::memcpy(dst, src, bytes);
  }
}

}  // namespace

at::Tensor slice_gather(at::TensorList sources, at::IntArrayRef source_ids, at::TensorList indices,
                        at::IntArrayRef dims) {
  const GatherPlan plan(sources, source_ids, indices, dims, "slice_gather");
  const auto& src0 = plan.sources[0];
  auto out = at::empty({plan.total()}, src0.options());
  const int64_t J = plan.segments();
  if (plan.total() == 0) return out;
  const int64_t esize = src0.element_size();
  // Rows of all segments, numbered consecutively: segment j has rows row_start[j] .. row_start[j+1].
  std::vector<int64_t> row_start(J + 1, 0);
  for (int64_t j = 0; j < J; ++j) row_start[j + 1] = row_start[j] + plan.view[j].outer * plan.idx.len[j];
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, row_start[J], row_grain(plan.total() * esize, row_start[J]), [&](int64_t r0, int64_t r1) {
    int64_t j = find_segment(row_start.data(), J, r0);
    for (int64_t r = r0; r < r1; ++r) {
      while (r >= row_start[j + 1]) ++j;
      const SliceView& v = plan.view[j];
      const int64_t local = r - row_start[j];
      const char* src = static_cast<const char*>(plan.sources[plan.source[j]].const_data_ptr());
      const int64_t from = segment_row_source(v, plan.idx.len[j], plan.idx.ptr[j], local);
      copy_row(dst + (plan.offset[j] + local * v.inner) * esize, src + from * esize, v.inner * esize);
    }
  });
  return out;
}

namespace {

// One row of a target: owners[0..k) are the rows of the owning segments, in segment order.
template <typename scalar_t, SliceReduce R>
void reduce_row(scalar_t* out, const scalar_t* const* owners, int64_t k, int64_t inner) {
  constexpr bool kIntegral = std::is_integral_v<scalar_t>;
  using acc_t = std::conditional_t<kIntegral, int64_t, at::opmath_type<scalar_t>>;
  constexpr int64_t kChunk = 256;
  acc_t acc[kChunk];
  for (int64_t c0 = 0; c0 < inner; c0 += kChunk) {
    const int64_t m = std::min(kChunk, inner - c0);
    scalar_t* o = out + c0;
    if constexpr (R == SliceReduce::Sum) {
      for (int64_t c = 0; c < m; ++c) acc[c] = static_cast<acc_t>(o[c]);
      for (int64_t l = 0; l < k; ++l) {
        const scalar_t* u = owners[l] + c0;
        for (int64_t c = 0; c < m; ++c) acc[c] += static_cast<acc_t>(u[c]);
      }
    } else {
      const scalar_t* u1 = owners[0] + c0;
      for (int64_t c = 0; c < m; ++c) acc[c] = mean_begin<kIntegral>(static_cast<acc_t>(u1[c]));
      for (int64_t l = 1; l < k; ++l) {
        const scalar_t* u = owners[l] + c0;
        for (int64_t c = 0; c < m; ++c)
          acc[c] = mean_step<kIntegral>(acc[c], static_cast<acc_t>(u1[c]), static_cast<acc_t>(u[c]));
      }
      for (int64_t c = 0; c < m; ++c) acc[c] = mean_finish<kIntegral>(acc[c], static_cast<acc_t>(u1[c]), k);
    }
    for (int64_t c = 0; c < m; ++c) o[c] = static_cast<scalar_t>(acc[c]);
  }
}

// Visit every owned row of every active target: fn(a, target_row, owner_rows, k), owner_rows in
// segment order. Rows of all targets are numbered consecutively and split among threads.
template <typename Fn>
void for_each_owned_row(const ScatterPlan& plan, int64_t esize, Fn fn) {
  const int64_t A = plan.active();
  std::vector<int64_t> row_start(A + 1, 0);
  int64_t bytes = 0;
  for (int64_t a = 0; a < A; ++a) {
    const int64_t owned = plan.owned_begin[a + 1] - plan.owned_begin[a];
    row_start[a + 1] = row_start[a] + plan.view[a].outer * owned;
    bytes += plan.view[a].outer * owned * plan.view[a].inner * esize;
  }
  if (row_start[A] == 0) return;
  at::parallel_for(0, row_start[A], row_grain(bytes, row_start[A]), [&](int64_t r0, int64_t r1) {
    std::vector<const char*> owners;
    int64_t a = find_segment(row_start.data(), A, r0);
    for (int64_t r = r0; r < r1; ++r) {
      while (r >= row_start[a + 1]) ++a;
      const SliceView& v = plan.view[a];
      const int64_t num_owned = plan.owned_begin[a + 1] - plan.owned_begin[a];
      const int64_t local = r - row_start[a];
      const int64_t o = local / num_owned;
      const int64_t i = plan.owned[plan.owned_begin[a] + (local - o * num_owned)];
      owners.clear();
      for (int64_t s = plan.seg_begin[a]; s < plan.seg_begin[a + 1]; ++s) {
        const int64_t j = plan.seg[s];
        const int32_t p = plan.pos[plan.pos_offset[j] + i];
        if (p < 0) continue;
        const char* u = static_cast<const char*>(plan.updates[j].const_data_ptr());
        owners.push_back(u + segment_offset(v, plan.n[j], o, p, 0) * esize);
      }
      char* t = static_cast<char*>(plan.work[a].data_ptr());
      fn(a, t + full_offset(v, o, i, 0) * esize, owners.data(), static_cast<int64_t>(owners.size()));
    }
  });
}

}  // namespace

void slice_scatter_(at::TensorList targets, at::IntArrayRef target_ids, at::TensorList updates,
                    at::TensorList indices, at::IntArrayRef dims, c10::string_view reduce) {
  const ScatterPlan plan(targets, target_ids, updates, indices, dims, reduce, "slice_scatter_");
  if (plan.active() == 0) return;
  const auto dtype = targets[0].scalar_type();
  const int64_t esize = targets[0].element_size();
  if (plan.reduce == SliceReduce::Copy) {
    // The last owner wins: a plain row copy, whatever the dtype.
    for_each_owned_row(plan, esize, [&](int64_t a, char* row, const char* const* owners, int64_t k) {
      copy_row(row, owners[k - 1], plan.view[a].inner * esize);
    });
  } else {
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "slice_scatter_", [&] {
      for_each_owned_row(plan, esize, [&](int64_t a, char* row, const char* const* owners, int64_t k) {
        auto* out = reinterpret_cast<scalar_t*>(row);
        auto* rows = reinterpret_cast<const scalar_t* const*>(owners);
        if (plan.reduce == SliceReduce::Sum)
          reduce_row<scalar_t, SliceReduce::Sum>(out, rows, k, plan.view[a].inner);
        else
          reduce_row<scalar_t, SliceReduce::Mean>(out, rows, k, plan.view[a].inner);
      });
    });
  }
  plan.copy_back(targets);
}

TORCH_LIBRARY_IMPL(ist_kernels, CPU, m) {
  m.impl("slice_gather", &slice_gather);
  m.impl("slice_scatter_", &slice_scatter_);
}

}  // namespace ist::cpu
