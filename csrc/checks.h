#pragma once
// Argument checks shared by the CPU kernels and the CUDA bindings. Every message names the op
// and the argument, and says what was expected; checks run before anything is written.
//
// One exception type per kind of mistake, the same on every path (C++ kernels, fake kernels, Triton
// launchers; the policy is written out in ist_kernels/ops/_checks.py, each family's own checks in
// its package, ist_kernels/ops/<family>/):
//   TORCH_CHECK_TYPE  -> TypeError:  a tensor of the wrong dtype;
//   TORCH_CHECK_INDEX -> IndexError: an index out of range (an index-list entry, an id, a dim);
//   TORCH_CHECK_VALUE -> ValueError: everything else (shape, device, length, repeats, aliasing).
#include <torch/all.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/gates.h"
#include "common/indices.h"

namespace ist {

// Declared first thing in every kernel: the ATen calls inside (at::mm, at::addmm, ...) never autocast
// by themselves, so a kernel's output dtype is its inputs' dtype, as its fake kernel says, however it
// is reached. Autocast is applied once, outside, by the ops' autocast kernels (csrc/autocast.cpp).
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

inline void check_gate_mask(const at::Tensor& mask, const char* op) {
  TORCH_CHECK_VALUE(mask.dim() >= 1, op, ": mask must have at least 1 dimension (features last), got a 0-d tensor");
  const auto t = mask.scalar_type();
  TORCH_CHECK_TYPE(t == at::kBool || at::isFloatingType(t), op,
                   ": mask must be bool or floating point (> 0 means on), got ", t);
}

inline void check_gate_words(const at::Tensor& words, int64_t num_features, const char* op) {
  TORCH_CHECK_TYPE(words.scalar_type() == at::kInt, op, ": words must be int32 (packed gates), got ",
                   words.scalar_type());
  TORCH_CHECK_VALUE(words.dim() >= 1, op, ": words must have at least 1 dimension, got a 0-d tensor");
  TORCH_CHECK_VALUE(num_features >= 0, op, ": num_features must be >= 0, got ", num_features);
  TORCH_CHECK_VALUE(gate_words(num_features) == words.size(-1), op, ": num_features=", num_features, " needs ",
                    gate_words(num_features), " words per row, but words has ", words.size(-1));
}

// An optional index list `name` (int64, 1-D, on `device`) into a dimension of `size` slices,
// described as `what` in messages (e.g. "weight dim 0"). Entries must be in range and, unless
// `allow_duplicates`, unique. Values are read on the host (a CUDA list is copied there first).
// Returns the bitmap of selected slices (see common/indices.h); all slices when the list is absent.
inline std::vector<uint32_t> check_index_list(const std::optional<at::Tensor>& idx, int64_t size, const char* op,
                                              const char* name, const char* what, const at::Device& device,
                                              bool allow_duplicates = false) {
  std::vector<uint32_t> bitmap(static_cast<size_t>(index_bitmap_words(size)), 0u);
  if (!idx.has_value()) {
    for (int64_t i = 0; i < size; ++i) index_mark(bitmap.data(), i);
    return bitmap;
  }
  const at::Tensor& t = *idx;
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": ", name, " must be an int64 index list, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), " dimensions");
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but the other tensors are on ",
                    device);
  const at::Tensor host = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  const IndexCheck r = check_indices(host.const_data_ptr<int64_t>(), host.numel(), size, bitmap.data(),
                                     allow_duplicates);
  TORCH_CHECK_INDEX(r.status != IndexStatus::kOutOfRange, op, ": ", name, "[", r.position, "] = ", r.value,
                    " is out of range for ", what, " of size ", size);
  TORCH_CHECK_VALUE(r.status != IndexStatus::kDuplicate, op, ": ", name, " must not repeat an index, but ", name,
                    "[", r.position, "] = ", r.value, " repeats ", name, "[", r.first, "]");
  return bitmap;
}

// output_mask of a backward op: (grad_x, grad_weight, grad_bias). The schema says bool[3], but the
// dispatcher does not check the length; a kernel taking c10::List<bool> checks it here.
inline std::array<bool, 3> check_output_mask(const c10::List<bool>& mask, const char* op) {
  TORCH_CHECK_VALUE(mask.size() == 3, op, ": output_mask must have 3 entries (grad_x, grad_weight, grad_bias), got ",
                    mask.size());
  return {mask[0], mask[1], mask[2]};
}

// ---- memory overlap of two tensors (out= / in-place arguments against every input)
enum class Overlap { kNo, kYes, kUnknown };

// Sorted [begin, end) byte intervals of t's elements (addresses).
inline std::vector<std::pair<uintptr_t, uintptr_t>> element_bytes(const at::Tensor& t) {
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  out.reserve(static_cast<size_t>(t.numel()));
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto es = static_cast<uintptr_t>(t.element_size());
  const int64_t nd = t.dim();
  std::vector<int64_t> at(nd, 0);
  for (int64_t e = 0; e < t.numel(); ++e) {
    int64_t off = 0;
    for (int64_t d = 0; d < nd; ++d) off += at[d] * t.stride(d);
    const uintptr_t b = base + static_cast<uintptr_t>(off) * es;
    out.emplace_back(b, b + es);
    for (int64_t d = nd - 1; d >= 0 && ++at[d] == t.size(d); --d) at[d] = 0;
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Elements up to which two strided views of one storage whose byte ranges interleave are compared
// element by element; beyond it the answer is kUnknown (treated as shared).
constexpr int64_t kExactOverlapMax = int64_t{1} << 20;

// Do a and b share a byte? kNo when either is empty, their storages differ or their byte ranges are
// disjoint (strided views side by side are fine); exact when both are non-overlapping and dense
// (each then fills its range); otherwise (interleaved strided views) exact by comparing the
// elements' byte intervals, up to kExactOverlapMax elements.
inline Overlap memory_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return Overlap::kNo;
  if (!a.has_storage() || !b.has_storage() || !a.storage().is_alias_of(b.storage())) return Overlap::kNo;
  auto range = [](const at::Tensor& t) {
    int64_t lo = 0, hi = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t ext = (t.size(d) - 1) * t.stride(d);
      (ext < 0 ? lo : hi) += ext;
    }
    const auto p = reinterpret_cast<intptr_t>(t.const_data_ptr());
    const auto es = static_cast<intptr_t>(t.element_size());
    return std::pair<intptr_t, intptr_t>{p + lo * es, p + (hi + 1) * es};
  };
  const auto ra = range(a), rb = range(b);
  if (ra.second <= rb.first || rb.second <= ra.first) return Overlap::kNo;
  if (a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense()) return Overlap::kYes;
  if (a.numel() + b.numel() > kExactOverlapMax) return Overlap::kUnknown;
  const auto ea = element_bytes(a), eb = element_bytes(b);
  for (size_t i = 0, j = 0; i < ea.size() && j < eb.size();) {
    if (ea[i].second <= eb[j].first) ++i;
    else if (eb[j].second <= ea[i].first) ++j;
    else return Overlap::kYes;
  }
  return Overlap::kNo;
}

// " shares memory with " or " may share memory with " (for the message of a failed overlap check).
inline const char* overlap_words(Overlap o) {
  return o == Overlap::kYes ? " shares memory with "
                            : " may share memory with (interleaved strided views too large to compare) ";
}

}  // namespace ist

// ---- GReLU layers (relu_gates, gated_linear, gated_linear_backward): x [..., K], weight [N, K],
// bias [N] or none, gates [..., ceil(N/32)] int32 with x's leading dimensions.
namespace ist {

inline bool grelu_dtype_ok(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_grelu_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension (features last), got a 0-d tensor");
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got ", weight.dim(),
                    "-D");
  TORCH_CHECK_TYPE(grelu_dtype_ok(x.scalar_type()), op,
                   ": x must be float32, float64, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype ", x.scalar_type(),
                   ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.device() == x.device(), op, ": weight is on ", weight.device(), " but x is on ",
                    x.device(), "; all tensors must be on one device");
  TORCH_CHECK_VALUE(x.size(-1) == weight.size(1), op, ": x has ", x.size(-1),
                    " features (last dim) but weight expects ", weight.size(1), " (weight is [", weight.size(0),
                    ", ", weight.size(1), "])");
  if (bias.has_value()) {
    const auto& b = *bias;
    TORCH_CHECK_VALUE(b.device() == x.device(), op, ": bias is on ", b.device(), " but x is on ", x.device(),
                      "; all tensors must be on one device");
    TORCH_CHECK_TYPE(b.scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ", x.scalar_type(),
                     ", got ", b.scalar_type());
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == weight.size(0), op, ": bias must be [", weight.size(0),
                      "] (out_features), got ", b.sizes());
  }
}

// gates must be int32 [*lead, ceil(N/32)] where lead are x's (or grad_out's) leading dimensions.
inline void check_grelu_gates(const char* op, const at::Tensor& gates, const at::Tensor& x, int64_t num_features) {
  TORCH_CHECK_VALUE(gates.device() == x.device(), op, ": gates is on ", gates.device(), " but x is on ", x.device(),
                    "; all tensors must be on one device");
  TORCH_CHECK_TYPE(gates.scalar_type() == at::kInt, op, ": gates must be int32 (packed with pack_gates), got ",
                   gates.scalar_type());
  auto expected = x.sizes().vec();
  expected.back() = gate_words(num_features);
  TORCH_CHECK_VALUE(gates.sizes() == at::IntArrayRef(expected), op, ": gates must be ", at::IntArrayRef(expected),
                    " (x's leading dims, ceil(", num_features, "/32) words), got ", gates.sizes());
}

}  // namespace ist
