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

// Unsigned type of an element size: copies move elements as such, whatever the dtype.
template <int Bytes> struct Word;
template <> struct Word<1> { using type = uint8_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<8> { using type = uint64_t; };
struct Word16 { uint64_t lo, hi; };
template <> struct Word<16> { using type = Word16; };

// Copy a row of n elements of type W: a plain loop for the short rows of slicing along a late dim
// (a 3x3 kernel's 9 elements), memcpy for long ones.
template <typename W>
inline void copy_row(char* dst, const char* src, int64_t n) {
  if (n * static_cast<int64_t>(sizeof(W)) >= 256) {
    std::memcpy(dst, src, n * sizeof(W));
    return;
  }
  auto* d = reinterpret_cast<W*>(dst);
  const auto* s = reinterpret_cast<const W*>(src);
  for (int64_t c = 0; c < n; ++c) d[c] = s[c];
}

// Run fn.template operator()<W>() with W the unsigned word of the element size.
template <typename Fn>
void with_word(int64_t element_size, Fn&& fn) {
  switch (element_size) {
    case 1: return fn(Word<1>{});
    case 2: return fn(Word<2>{});
    case 4: return fn(Word<4>{});
    case 8: return fn(Word<8>{});
    case 16: return fn(Word<16>{});
    default: TORCH_CHECK_TYPE(false, "slice ops: unsupported element size ", element_size);
  }
}

}  // namespace

namespace {

// The gather kernel: every segment of a checked plan into out (contiguous, plan.total() elements).
void gather_into(const GatherPlan& plan, const at::Tensor& out) {
  const auto& src0 = plan.sources[0];
  const int64_t J = plan.segments();
  if (plan.total() == 0) return;
  const int64_t esize = src0.element_size();
  // Rows of all segments, numbered consecutively: segment j has rows row_start[j] .. row_start[j+1].
  std::vector<int64_t> row_start(J + 1, 0);
  for (int64_t j = 0; j < J; ++j) row_start[j + 1] = row_start[j] + plan.view[j].outer * plan.idx.len[j];
  std::vector<const char*> src(J);
  for (int64_t j = 0; j < J; ++j) src[j] = static_cast<const char*>(plan.sources[plan.source[j]].const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  with_word(esize, [&](auto word) {
    using W = typename decltype(word)::type;
    at::parallel_for(0, row_start[J], row_grain(plan.total() * esize, row_start[J]), [&](int64_t r0, int64_t r1) {
      int64_t j = find_segment(row_start.data(), J, r0);
      for (int64_t r = r0; r < r1;) {
        while (r >= row_start[j + 1]) ++j;
        // Rows r .. end of segment j: row (o, k) copies source row (o, idx[k]).
        const SliceView& v = plan.view[j];
        const int64_t n = plan.idx.len[j], end = std::min(r1, row_start[j + 1]);
        const int64_t* idx = plan.idx.ptr[j];
        const int64_t row_bytes = v.inner * esize, plane_bytes = v.size * row_bytes;
        const int64_t local = r - row_start[j];
        int64_t o = local / n, k = local - o * n;
        const char* plane = src[j] + full_offset(v, o, 0, 0) * esize;
        char* out_row = dst + (plan.offset[j] + segment_offset(v, n, o, k, 0)) * esize;
        for (; r < end; ++r, out_row += row_bytes) {
          copy_row<W>(out_row, plane + idx[k] * row_bytes, v.inner);
          if (++k == n) {
            k = 0;
            plane += plane_bytes;
          }
        }
      }
    });
  });
}

}  // namespace

at::Tensor slice_gather(at::TensorList sources, at::IntArrayRef source_ids, at::TensorList indices,
                        at::IntArrayRef dims) {
  const GatherPlan plan(sources, source_ids, indices, dims, "slice_gather");
  auto out = at::empty({plan.total()}, plan.sources[0].options());
  gather_into(plan, out);
  return out;
}

void slice_gather_into_(at::Tensor& out, at::TensorList sources, at::IntArrayRef source_ids, at::TensorList indices,
                        at::IntArrayRef dims) {
  const GatherPlan plan(sources, source_ids, indices, dims, "slice_gather_into_");
  plan.check_out(out, sources, indices, "slice_gather_into_");
  gather_into(plan, out);
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
      OwnerMean<acc_t, kIntegral> mean[kChunk];
      const scalar_t* u1 = owners[0] + c0;
      for (int64_t c = 0; c < m; ++c) mean[c].begin(static_cast<acc_t>(u1[c]));
      for (int64_t l = 1; l < k; ++l) {
        const scalar_t* u = owners[l] + c0;
        for (int64_t c = 0; c < m; ++c) mean[c].step(static_cast<acc_t>(u[c]));
      }
      for (int64_t c = 0; c < m; ++c) acc[c] = mean[c].finish(k);
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
  std::vector<const char*> upd(plan.updates.size());
  for (size_t j = 0; j < upd.size(); ++j) upd[j] = static_cast<const char*>(plan.updates[j].const_data_ptr());
  std::vector<char*> work(A);
  for (int64_t a = 0; a < A; ++a) work[a] = static_cast<char*>(plan.work[a].data_ptr());
  at::parallel_for(0, row_start[A], row_grain(bytes, row_start[A]), [&](int64_t r0, int64_t r1) {
    std::vector<const char*> owners;
    int64_t a = find_segment(row_start.data(), A, r0);
    for (int64_t r = r0; r < r1;) {
      while (r >= row_start[a + 1]) ++a;
      // Rows r .. end of target a: row (o, u) is slice i = owned[u] of outer index o.
      const SliceView& v = plan.view[a];
      const int64_t* owned = plan.owned_ptr + plan.owned_begin[a];
      const int64_t num_owned = plan.owned_begin[a + 1] - plan.owned_begin[a];
      const int64_t end = std::min(r1, row_start[a + 1]);
      const int64_t local = r - row_start[a];
      int64_t o = local / num_owned, u = local - o * num_owned;
      for (; r < end; ++r) {
        const int64_t i = owned[u];
        owners.clear();
        for (int64_t s = plan.seg_begin[a]; s < plan.seg_begin[a + 1]; ++s) {
          const int64_t j = plan.seg[s];
          const int32_t p = plan.pos_ptr[plan.pos_offset[j] + i];
          if (p >= 0) owners.push_back(upd[j] + segment_offset(v, plan.n[j], o, p, 0) * esize);
        }
        fn(a, work[a] + full_offset(v, o, i, 0) * esize, owners.data(), static_cast<int64_t>(owners.size()));
        if (++u == num_owned) {
          u = 0;
          ++o;
        }
      }
    }
  });
}

}  // namespace

namespace {

void scatter_into(const ScatterPlan& plan, at::TensorList targets) {
  if (plan.active() == 0) return;
  const auto dtype = targets[0].scalar_type();
  const int64_t esize = targets[0].element_size();
  if (plan.reduce == SliceReduce::Copy) {
    // The last owner wins: a plain row copy, whatever the dtype.
    with_word(esize, [&](auto word) {
      using W = typename decltype(word)::type;
      for_each_owned_row(plan, esize, [&](int64_t a, char* row, const char* const* owners, int64_t k) {
        copy_row<W>(row, owners[k - 1], plan.view[a].inner);
      });
    });
  } else {
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "slice_scatter_", [&] {
      for_each_owned_row(plan, esize, [&](int64_t a, char* row, const char* const* owners, int64_t k) {
        if (plan.reduce == SliceReduce::Mean && k == 1) {  // the mean of one owner is its value, bit for bit
          std::memcpy(row, owners[0], plan.view[a].inner * esize);
          return;
        }
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

}  // namespace

void slice_scatter_(at::TensorList targets, at::IntArrayRef target_ids, at::TensorList updates,
                    at::TensorList indices, at::IntArrayRef dims, c10::string_view reduce) {
  scatter_into(ScatterPlan(targets, target_ids, updates, indices, dims, reduce, "slice_scatter_"), targets);
}

// ---- The same kernels from a plan built once per round (slice_plan): per call only the cheap checks.
void slice_plan_gather_(at::Tensor& out, at::TensorList sources, const at::Tensor& plan, at::TensorList cache) {
  const char* op = "slice_plan_gather_";
  const PlanView p(plan, op);
  TORCH_CHECK_VALUE(cache.empty(), op, ": cache holds the device copy of a CUDA plan; give none on the CPU");
  const GatherPlan g(p, sources, op);
  g.check_out(out, sources, {}, op);
  gather_into(g, out);
}

void slice_plan_scatter_(at::TensorList targets, at::TensorList updates, const at::Tensor& plan,
                         c10::string_view reduce, at::TensorList cache) {
  const char* op = "slice_plan_scatter_";
  const PlanView p(plan, op);
  TORCH_CHECK_VALUE(cache.empty(), op, ": cache holds the device copy of a CUDA plan; give none on the CPU");
  scatter_into(ScatterPlan(p, targets, updates, reduce, op), targets);
}

TORCH_LIBRARY_IMPL(ist_kernels, CPU, m) {
  m.impl("slice_gather", &slice_gather);
  m.impl("slice_gather_into_", &slice_gather_into_);
  m.impl("slice_scatter_", &slice_scatter_);
  m.impl("slice_plan_gather_", &slice_plan_gather_);
  m.impl("slice_plan_scatter_", &slice_plan_scatter_);
}

// Building a plan is host work on shapes and index lists, whatever the tensors' device.
at::Tensor slice_plan(at::TensorList tensors, at::IntArrayRef ids, at::TensorList indices, at::IntArrayRef dims) {
  return build_slice_plan(tensors, ids, indices, dims, "slice_plan");
}

TORCH_LIBRARY_IMPL(ist_kernels, CompositeExplicitAutograd, m) {
  m.impl("slice_plan", &slice_plan);
}

}  // namespace ist::cpu
