// Every op schema of ist_kernels, in one place. Backends register their kernels with
// TORCH_LIBRARY_IMPL in csrc/cpu/*.cpp and csrc/cuda/*.cpp (or from Python for Triton);
// fake kernels and autograd live in ist_kernels/ops/.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import ist_kernels._C` runs the static registrations below; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(ist_kernels, m) {
  // ---- 1-bit gates (GReLU, paper 004 §2.1). Bit j of int32 word w is feature 32*w + j.
  // mask [..., F] (bool, or floating where > 0 means on) -> words [..., ceil(F/32)] int32
  m.def("pack_gates(Tensor mask) -> Tensor");
  // words [..., W] int32 -> mask [..., num_features] bool (num_features <= 32*W)
  m.def("unpack_gates(Tensor words, int num_features) -> Tensor");

  // ---- GReLU layers (paper 004 §2.1, §4.4)
  // out = relu(x W^T + b), gates = pack(x W^T + b > 0); the frozen gate network, no gradient.
  m.def("relu_gates(Tensor x, Tensor weight, Tensor? bias) -> (Tensor out, Tensor gates)");
  // y = (x W^T + b) * unpack(gates)
  m.def("gated_linear(Tensor x, Tensor weight, Tensor? bias, Tensor gates) -> Tensor");
  // g' = grad_out * G; grad_x = g' W, grad_weight = g'^T x, grad_bias = sum g'.
  // output_mask = (grad_x, grad_weight, grad_bias); an output not asked for is an empty tensor.
  m.def(
      "gated_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor gates, bool[3] output_mask)"
      " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");

  // ---- Subnetworks of neurons (IST, paper 001 §3.1)
  // y = x W[rows][:, cols]^T + b[rows]; rows/cols are int64 index lists (None = all).
  m.def("subnet_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? rows, Tensor? cols) -> Tensor");
  // grad_x is compact ([..., len(cols)]); grad_weight / grad_bias are full-size and zero outside
  // rows x cols. output_mask as for gated_linear_backward.
  m.def(
      "subnet_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? rows, Tensor? cols,"
      " bool[3] output_mask) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");

  // ---- Multi-tensor slices (partitions: LOFT, ResIST, IST; distributed exchange)
  // Segment j is sources[source_ids[j]].index_select(dims[source_ids[j]], indices[j]); the result
  // is every segment flattened (row-major) and concatenated, in one buffer, in one launch.
  m.def("slice_gather(Tensor[] sources, int[] source_ids, Tensor[] indices, int[] dims) -> Tensor");
  // slice_gather written into a caller's buffer: out must be a contiguous 1-D tensor of the sources'
  // dtype and device with exactly the gather's numel, sharing no memory with a source (checked
  // before anything is written). Lets a caller reuse one buffer across calls (no allocation, no
  // fresh pages). Not differentiable.
  m.def(
      "slice_gather_into_(Tensor(a!) out, Tensor[] sources, int[] source_ids, Tensor[] indices, int[] dims)"
      " -> ()");
  // Segment j (updates[j], compact, contiguous) is written back into targets[target_ids[j]] along
  // dims[target_ids[j]] at indices[j]. reduce: "copy" (one owner per slice; the last segment wins),
  // "sum" (target += sum over owners), "mean" (target = mean over owners). Slices that no segment
  // owns keep their value; owner counts come from the indices, never from the data.
  m.def(
      "slice_scatter_(Tensor(a!)[] targets, int[] target_ids, Tensor[] updates, Tensor[] indices,"
      " int[] dims, str reduce) -> ()");
}
