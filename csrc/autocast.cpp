// Autocast for every GEMM-shaped op (and its backward): under torch.autocast(device, dtype) the
// floating-point tensor arguments on that device are cast to the autocast dtype (float64 and
// integer tensors -- packed gate words, index lists -- are left alone, as torch's own
// lower_precision_fp ops do, through the same weight-cast cache), then the op runs with that
// device's autocast key excluded, so its output has the dtype the fake kernel promises. One boxed
// kernel for all of them, as torchvision's csrc/ops/autocast/ does per op; registered for CPU and
// CUDA (the CUDA kernels themselves are Python: ist_kernels/ops/).
//
// The kernels also never re-enter autocast by themselves (ist::NoAutocast in checks.h), so calling an
// op's backend directly inside an autocast region gives the same dtypes.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace ist {
namespace {

template <c10::DeviceType kDevice>
void autocast_lower_precision(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto n = op.schema().arguments().size();
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it)
    if (it->isTensor()) *it = at::autocast::cached_cast(dtype, it->toTensor(), kDevice);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  op.callBoxed(stack);
}

constexpr const char* kGemmOps[] = {"relu_gates", "gated_linear", "gated_linear_backward", "subnet_linear",
                                    "subnet_linear_backward"};

}  // namespace

TORCH_LIBRARY_IMPL(ist_kernels, AutocastCPU, m) {
  for (const char* name : kGemmOps)
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_lower_precision<c10::DeviceType::CPU>>());
}

TORCH_LIBRARY_IMPL(ist_kernels, AutocastCUDA, m) {
  for (const char* name : kGemmOps)
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_lower_precision<c10::DeviceType::CUDA>>());
}

}  // namespace ist
