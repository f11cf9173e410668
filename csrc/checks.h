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
