#pragma once
// Argument checks shared by the CPU kernels and the CUDA bindings. Every message names the op
// and the argument, and says what was expected; checks run before anything is written.
#include <torch/all.h>

#include <optional>
#include <vector>

#include "common/gates.h"
#include "common/indices.h"

namespace ist {

inline void check_gate_mask(const at::Tensor& mask, const char* op) {
  TORCH_CHECK(mask.dim() >= 1, op, ": mask must have at least 1 dimension (features last), got a 0-d tensor");
  const auto t = mask.scalar_type();
  TORCH_CHECK(t == at::kBool || at::isFloatingType(t), op,
              ": mask must be bool or floating point (> 0 means on), got ", t);
}

inline void check_gate_words(const at::Tensor& words, int64_t num_features, const char* op) {
  TORCH_CHECK(words.scalar_type() == at::kInt, op, ": words must be int32 (packed gates), got ", words.scalar_type());
  TORCH_CHECK(words.dim() >= 1, op, ": words must have at least 1 dimension, got a 0-d tensor");
  TORCH_CHECK(num_features >= 0 && gate_words(num_features) == words.size(-1), op, ": num_features=", num_features,
              " needs ", gate_words(std::max<int64_t>(num_features, 0)), " words per row, but words has ",
              words.size(-1));
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
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be an int64 index list, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), " dimensions");
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but the other tensors are on ", device);
  const at::Tensor host = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  const IndexCheck r = check_indices(host.const_data_ptr<int64_t>(), host.numel(), size, bitmap.data(),
                                     allow_duplicates);
  TORCH_CHECK(r.status != IndexStatus::kOutOfRange, op, ": ", name, "[", r.position, "] = ", r.value,
              " is out of range for ", what, " of size ", size);
  TORCH_CHECK(r.status != IndexStatus::kDuplicate, op, ": ", name, " must not repeat an index, but ", name, "[",
              r.position, "] = ", r.value, " repeats ", name, "[", r.first, "]");
  return bitmap;
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
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension (features last), got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got ", weight.dim(), "-D");
  TORCH_CHECK(grelu_dtype_ok(x.scalar_type()), op,
              ": x must be float32, float64, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype ", x.scalar_type(),
              ", got ", weight.scalar_type());
  TORCH_CHECK(weight.device() == x.device(), op, ": weight is on ", weight.device(), " but x is on ", x.device(),
              "; all tensors must be on one device");
  TORCH_CHECK(x.size(-1) == weight.size(1), op, ": x has ", x.size(-1), " features (last dim) but weight expects ",
              weight.size(1), " (weight is [", weight.size(0), ", ", weight.size(1), "])");
  if (bias.has_value()) {
    const auto& b = *bias;
    TORCH_CHECK(b.device() == x.device(), op, ": bias is on ", b.device(), " but x is on ", x.device(),
                "; all tensors must be on one device");
    TORCH_CHECK(b.scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ", x.scalar_type(), ", got ",
                b.scalar_type());
    TORCH_CHECK(b.dim() == 1 && b.size(0) == weight.size(0), op, ": bias must be [", weight.size(0),
                "] (out_features), got ", b.sizes());
  }
}

// gates must be int32 [*lead, ceil(N/32)] where lead are x's (or grad_out's) leading dimensions.
inline void check_grelu_gates(const char* op, const at::Tensor& gates, const at::Tensor& x, int64_t num_features) {
  TORCH_CHECK(gates.device() == x.device(), op, ": gates is on ", gates.device(), " but x is on ", x.device(),
              "; all tensors must be on one device");
  TORCH_CHECK(gates.scalar_type() == at::kInt, op, ": gates must be int32 (packed with pack_gates), got ",
              gates.scalar_type());
  auto expected = x.sizes().vec();
  expected.back() = gate_words(num_features);
  TORCH_CHECK(gates.sizes() == at::IntArrayRef(expected), op, ": gates must be ", at::IntArrayRef(expected),
              " (x's leading dims, ceil(", num_features, "/32) words), got ", gates.sizes());
}

}  // namespace ist
