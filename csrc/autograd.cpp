// Autograd of the differentiable ops, in C++ (the Autograd dispatch key, for every backend), as
// torchvision's csrc/ops/autograd/ does. torch.library.register_autograd put a Python
// autograd.Function and a Python redispatch on every call, about 15 us of host time on a CPU
// call whose kernel takes 3 us (bench/bench_overhead.py, issue 19 item 1); here a call that needs
// no gradient goes straight below autograd, and one that does builds one C++ node.
//
// gated_linear: gradients for x, weight and bias through gated_linear_backward (g' = g ⊙ G inside
//   its kernels); subnet_linear: compact grad_x, full-size grad_weight / grad_bias through
//   subnet_linear_backward; relu_gates: none -- it is GReLU's frozen gate network (paper 004
//   §2.1), so its backward raises instead of returning zeros; slice_gather: the gradient of a
//   source is its segments' gradients scattered back (slice_scatter_ reduce="sum" into zeros, one
//   launch for every source that needs one).
// slice_gather_segments (CompositeImplicitAutograd) is slice_gather plus the views of its flat
// result as the segment tensors, built here in C++: done in Python, the split and one .view per
// segment cost more host time than the gather itself on small tensors.
// The backward ops themselves have no gradient (no double backward), as before.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

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

const auto& slice_gather_op() {
  static const auto op = handle<at::Tensor(at::TensorList, at::IntArrayRef, at::TensorList, at::IntArrayRef)>(
      "ist_kernels::slice_gather");
  return op;
}
const auto& slice_scatter_op() {
  static const auto op = handle<void(at::TensorList, at::IntArrayRef, at::TensorList, at::TensorList, at::IntArrayRef,
                                     c10::string_view)>("ist_kernels::slice_scatter_");
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

// The shape of segment j: its source's shape with len(indices[j]) along the (wrapped) dim. Called
// after slice_gather has validated the arguments, so ids and dims are in range here.
std::vector<c10::SymInt> segment_shape(c10::SymIntArrayRef source, int64_t dim, const c10::SymInt& length) {
  std::vector<c10::SymInt> shape(source.begin(), source.end());
  shape[static_cast<size_t>(c10::maybe_wrap_dim(dim, static_cast<int64_t>(source.size())))] = length;
  return shape;
}

// Views of a flat gather buffer as the compact segment tensors (row-major, in segment order).
std::vector<at::Tensor> segment_views(const at::Tensor& flat, const std::vector<std::vector<c10::SymInt>>& shapes) {
  if (shapes.empty()) return {};
  std::vector<c10::SymInt> numels;
  numels.reserve(shapes.size());
  for (const auto& shape : shapes) {
    c10::SymInt n = 1;
    for (const auto& x : shape) n = n * x;
    numels.push_back(n);
  }
  auto parts = flat.split_with_sizes_symint(numels);
  for (size_t j = 0; j < parts.size(); ++j) parts[j] = parts[j].view_symint(shapes[j]);
  return parts;
}

struct SliceGather : public torch::autograd::Function<SliceGather> {
  static at::Tensor forward(AutogradContext* ctx, at::TensorList sources, at::IntArrayRef source_ids,
                            at::TensorList indices, at::IntArrayRef dims) {
    at::Tensor flat = slice_gather_op().call(sources, source_ids, indices, dims);  // validates everything
    std::vector<int64_t> ranks, sizes;
    for (const auto& s : sources) {
      ranks.push_back(s.dim());
      for (int64_t x : s.sizes()) sizes.push_back(x);
    }
    ctx->saved_data["num_sources"] = static_cast<int64_t>(sources.size());
    ctx->saved_data["ranks"] = c10::List<int64_t>(ranks);
    ctx->saved_data["sizes"] = c10::List<int64_t>(sizes);
    ctx->saved_data["source_ids"] = c10::List<int64_t>(source_ids.vec());
    ctx->saved_data["dims"] = c10::List<int64_t>(dims.vec());
    ctx->save_for_backward(indices.vec());
    return flat;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t n = ctx->saved_data["num_sources"].toInt();
    const auto ranks = ctx->saved_data["ranks"].toIntVector();
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const auto ids = ctx->saved_data["source_ids"].toIntVector();
    const auto dims = ctx->saved_data["dims"].toIntVector();
    const auto indices = ctx->get_saved_variables();
    // apply() saw: the n sources, source_ids, the indices, dims (one gradient slot each).
    variable_list out(static_cast<size_t>(n) + 1 + indices.size() + 1);
    if (!grads[0].defined()) return out;  // no gradient reached the gather
    const at::Tensor grad = grads[0].contiguous();
    std::vector<std::vector<int64_t>> shapes(n);
    for (int64_t s = 0, off = 0; s < n; off += ranks[s], ++s)
      shapes[s].assign(sizes.begin() + off, sizes.begin() + off + ranks[s]);
    // The targets: a zeroed gradient for each source that needs one, renumbered.
    std::vector<int64_t> local(n, -1), target_dims;
    std::vector<at::Tensor> targets;
    for (int64_t s = 0; s < n; ++s) {
      if (!ctx->needs_input_grad(s)) continue;
      local[s] = static_cast<int64_t>(targets.size());
      targets.push_back(at::zeros(shapes[s], grad.options()));
      target_dims.push_back(dims[s]);
    }
    if (targets.empty()) return out;
    std::vector<std::vector<c10::SymInt>> seg_shapes;
    std::vector<int64_t> seg_targets;
    std::vector<at::Tensor> seg_indices;
    std::vector<size_t> keep;
    for (size_t j = 0; j < ids.size(); ++j) {
      const auto& shape = shapes[ids[j]];
      seg_shapes.push_back(segment_shape(c10::fromIntArrayRefSlow(shape), dims[ids[j]], indices[j].sym_size(0)));
      if (local[ids[j]] < 0) continue;
      keep.push_back(j);
      seg_targets.push_back(local[ids[j]]);
      seg_indices.push_back(indices[j]);
    }
    const auto views = segment_views(grad, seg_shapes);
    if (!keep.empty()) {
      std::vector<at::Tensor> updates;
      for (size_t j : keep) updates.push_back(views[j]);
      slice_scatter_op().call(targets, seg_targets, updates, seg_indices, target_dims, "sum");
    }
    for (int64_t s = 0; s < n; ++s)
      if (local[s] >= 0) out[s] = targets[local[s]];
    return out;
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

at::Tensor slice_gather(at::TensorList sources, at::IntArrayRef source_ids, at::TensorList indices,
                        at::IntArrayRef dims) {
  bool any = false;
  if (at::GradMode::is_enabled())
    for (const auto& s : sources) any = any || (s.defined() && s.requires_grad());
  if (!any) {
    at::AutoDispatchBelowADInplaceOrView below;
    return slice_gather_op().call(sources, source_ids, indices, dims);
  }
  return SliceGather::apply(sources, source_ids, indices, dims);
}

// slice_gather, then its flat result viewed as the segment tensors. Composite: autograd, fake
// tensors and torch.compile see slice_gather, split_with_sizes and view.
std::vector<at::Tensor> slice_gather_segments(at::TensorList sources, at::IntArrayRef source_ids,
                                              at::TensorList indices, at::IntArrayRef dims) {
  at::Tensor flat = slice_gather_op().call(sources, source_ids, indices, dims);  // validates everything
  std::vector<std::vector<c10::SymInt>> shapes;
  shapes.reserve(source_ids.size());
  for (size_t j = 0; j < source_ids.size(); ++j) {
    const auto& src = sources[static_cast<size_t>(source_ids[j])];
    shapes.push_back(segment_shape(src.sym_sizes(), dims[static_cast<size_t>(source_ids[j])], indices[j].sym_size(0)));
  }
  return segment_views(flat, shapes);
}

}  // namespace

TORCH_LIBRARY_IMPL(ist_kernels, Autograd, m) {
  m.impl("gated_linear", &gated_linear);
  m.impl("subnet_linear", &subnet_linear);
  m.impl("relu_gates", &relu_gates);
  m.impl("slice_gather", &slice_gather);
}

TORCH_LIBRARY_IMPL(ist_kernels, CompositeImplicitAutograd, m) {
  m.impl("slice_gather_segments", &slice_gather_segments);
}

}  // namespace ist
