// Autograd of the differentiable ops, in C++ (the Autograd dispatch key, for every backend), as
// torchvision's csrc/ops/autograd/ does. torch.library.register_autograd put a Python
// autograd.Function and a Python redispatch on every call, about 15 us of host time on a CPU
// call whose kernel takes 3 us (bench/bench_overhead.py, issue 19 item 1); here a call that needs
// no gradient goes straight below autograd, and one that does builds one C++ node.
//
// gated_linear: gradients for x, weight and bias through gated_linear_backward (g' = g ⊙ G inside
//   its kernels); subnet_linear: compact grad_x, full-size grad_weight / grad_bias through
//   subnet_linear_backward; relu_gates: none -- it is GReLU's frozen gate network (paper 004
//   §2.1), so its backward raises instead of returning zeros.
// The backward ops themselves have no gradient (no double backward), as before.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace ist {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;
using Grads3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The typed handles, found once (the schemas are registered when _C loads, before any call).
const auto& gated_linear_op() {
  static const auto op = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&)>(
      "ist_kernels::gated_linear");
  return op;
}
const auto& gated_linear_backward_op() {
  static const auto op = handle<Grads3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const c10::List<bool>&)>("ist_kernels::gated_linear_backward");
  return op;
}
const auto& relu_gates_op() {
  static const auto op = handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const OptTensor&)>("ist_kernels::relu_gates");
  return op;
}
const auto& subnet_linear_op() {
  static const auto op = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                           const OptTensor&)>("ist_kernels::subnet_linear");
  return op;
}
const auto& subnet_linear_backward_op() {
  static const auto op = handle<Grads3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                       const OptTensor&, const c10::List<bool>&)>("ist_kernels::subnet_linear_backward");
  return op;
}

// Whether this call records a node: grad mode on and some floating input requires grad.
bool records(std::initializer_list<const at::Tensor*> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors)
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  return false;
}

const at::Tensor* opt(const OptTensor& t) { return t.has_value() ? &*t : nullptr; }
OptTensor present(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
at::Tensor keep_if(bool want, const at::Tensor& t) { return want ? t : at::Tensor(); }

struct GatedLinear : public torch::autograd::Function<GatedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                            const at::Tensor& gates) {
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->save_for_backward({x, weight, gates});
    return gated_linear_op().call(x, weight, bias, gates);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    auto [dx, dw, db] = gated_linear_backward_op().call(grads[0], saved[0], saved[1], saved[2],
                                                        c10::List<bool>({need_x, need_w, need_b}));
    return {keep_if(need_x, dx), keep_if(need_w, dw), keep_if(need_b, db), at::Tensor()};
  }
};

struct SubnetLinear : public torch::autograd::Function<SubnetLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                            const OptTensor& rows, const OptTensor& cols) {
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->save_for_backward({x, weight, rows.value_or(at::Tensor()), cols.value_or(at::Tensor())});
    return subnet_linear_op().call(x, weight, bias, rows, cols);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    auto [dx, dw, db] = subnet_linear_backward_op().call(grads[0], saved[0], saved[1], present(saved[2]),
                                                         present(saved[3]), c10::List<bool>({need_x, need_w, need_b}));
    return {keep_if(need_x, dx), keep_if(need_w, dw), keep_if(need_b, db), at::Tensor(), at::Tensor()};
  }
};

struct ReluGates : public torch::autograd::Function<ReluGates> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias) {
    auto [out, gates] = relu_gates_op().call(x, weight, bias);
    ctx->mark_non_differentiable({gates});
    return {out, gates};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "ist_kernels::relu_gates has no gradient: it is GReLU's frozen gate network (paper 004 §2.1), "
                "whose outputs are constants of the trained network. Pass inputs that do not require grad "
                "(buffers, or .detach()), or use gated_linear / torch.relu for a trainable layer.");
  }
};

at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const at::Tensor& gates) {
  if (!records({&x, &weight, opt(bias)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return gated_linear_op().call(x, weight, bias, gates);
  }
  return GatedLinear::apply(x, weight, bias, gates);
}

at::Tensor subnet_linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& rows,
                         const OptTensor& cols) {
  if (!records({&x, &weight, opt(bias)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return subnet_linear_op().call(x, weight, bias, rows, cols);
  }
  return SubnetLinear::apply(x, weight, bias, rows, cols);
}

std::tuple<at::Tensor, at::Tensor> relu_gates(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias) {
  if (!records({&x, &weight, opt(bias)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return relu_gates_op().call(x, weight, bias);
  }
  auto outs = ReluGates::apply(x, weight, bias);
  return {outs[0], outs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ist_kernels, Autograd, m) {
  m.impl("gated_linear", &gated_linear);
  m.impl("subnet_linear", &subnet_linear);
  m.impl("relu_gates", &relu_gates);
}

}  // namespace ist
