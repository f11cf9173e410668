// CPU kernels for pack_gates / unpack_gates.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/all.h>

#include "common/gates.h"
#include "checks.h"

namespace ist::cpu {
using ist::check_gate_mask;
using ist::check_gate_words;

at::Tensor pack_gates(const at::Tensor& mask) {
  check_gate_mask(mask, "pack_gates");
  const auto m = mask.contiguous();
  const int64_t F = m.size(-1);
  const int64_t rows = F == 0 ? 0 : m.numel() / F;
  const int64_t W = gate_words(F);
  auto sizes = m.sizes().vec();
  sizes.back() = W;
  auto words = at::empty(sizes, m.options().dtype(at::kInt));
  int32_t* out = words.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, m.scalar_type(), "pack_gates", [&] {
    const scalar_t* in = m.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = in + r * F;
        for (int64_t w = 0; w < W; ++w)
          out[r * W + w] = pack_word(w, F, [&](int64_t i) { return static_cast<float>(row[i]) > 0.f; });
      }
    });
  });
  return words;
}

at::Tensor unpack_gates(const at::Tensor& words, int64_t num_features) {
  check_gate_words(words, num_features, "unpack_gates");
  const auto wd = words.contiguous();
  const int64_t W = wd.size(-1);
  const int64_t rows = W == 0 ? 0 : wd.numel() / W;
  auto sizes = wd.sizes().vec();
  sizes.back() = num_features;
  auto mask = at::empty(sizes, wd.options().dtype(at::kBool));
  bool* out = mask.data_ptr<bool>();
  const int32_t* in = wd.const_data_ptr<int32_t>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t f = 0; f < num_features; ++f) out[r * num_features + f] = gate_on(in + r * W, f);
  });
  return mask;
}

TORCH_LIBRARY_IMPL(ist_kernels, CPU, m) {
  m.impl("pack_gates", &pack_gates);
  m.impl("unpack_gates", &unpack_gates);
}

}  // namespace ist::cpu
