// torch bindings of the CUDA gate kernels (csrc/cuda/gates.cu).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/gates.cuh"

namespace ist::cuda {
namespace {

MaskType mask_type(at::ScalarType t) {
  switch (t) {
    case at::kBool: return MaskType::Bool;
    case at::kFloat: return MaskType::Float32;
    case at::kDouble: return MaskType::Float64;
    case at::kHalf: return MaskType::Float16;
    case at::kBFloat16: return MaskType::BFloat16;
    default: TORCH_CHECK_TYPE(false, "pack_gates: unsupported mask dtype ", t);
  }
}

at::Tensor pack_gates_cuda(const at::Tensor& mask) {
  check_gate_mask(mask, "pack_gates");
  const c10::cuda::CUDAGuard guard(mask.device());
  const auto m = mask.contiguous();
  const int64_t F = m.size(-1);
  const int64_t rows = F == 0 ? 0 : m.numel() / F;
  auto sizes = m.sizes().vec();
  sizes.back() = gate_words(F);
  auto words = at::empty(sizes, m.options().dtype(at::kInt));
  C10_CUDA_CHECK(ist::cuda::pack_gates(m.const_data_ptr(), mask_type(m.scalar_type()), rows, F,
                                       words.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()));
  return words;
}

at::Tensor unpack_gates_cuda(const at::Tensor& words, int64_t num_features) {
  check_gate_words(words, num_features, "unpack_gates");
  const c10::cuda::CUDAGuard guard(words.device());
  const auto wd = words.contiguous();
  const int64_t W = wd.size(-1);
  const int64_t rows = W == 0 ? 0 : wd.numel() / W;
  auto sizes = wd.sizes().vec();
  sizes.back() = num_features;
  auto mask = at::empty(sizes, wd.options().dtype(at::kBool));
  C10_CUDA_CHECK(ist::cuda::unpack_gates(wd.const_data_ptr<int32_t>(), rows, num_features, mask.data_ptr<bool>(),
                                         c10::cuda::getCurrentCUDAStream()));
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(ist_kernels, CUDA, m) {
  m.impl("pack_gates", &pack_gates_cuda);
  m.impl("unpack_gates", &unpack_gates_cuda);
}

}  // namespace ist::cuda
