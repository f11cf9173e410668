#pragma once
// Argument checks shared by the CPU kernels and the CUDA bindings. Every message names the op
// and the argument, and says what was expected; checks run before anything is written.
#include <torch/all.h>

#include "common/gates.h"

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

}  // namespace ist
