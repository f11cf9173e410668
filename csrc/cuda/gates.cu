#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/gates.h"
#include "cuda/gates.cuh"

namespace ist::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ bool is_on(T v) { return static_cast<float>(v) > 0.f; }
template <>
__device__ __forceinline__ bool is_on<bool>(bool v) { return v; }
template <>
__device__ __forceinline__ bool is_on<double>(double v) { return v > 0.0; }
// torch builds with __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__: convert explicitly.
template <>
__device__ __forceinline__ bool is_on<__half>(__half v) { return __half2float(v) > 0.f; }
template <>
__device__ __forceinline__ bool is_on<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v) > 0.f; }

// One warp per packed word: lane j reads feature 32w + j (coalesced) and the warp ballots.
template <typename T>
__global__ void pack_gates_kernel(const T* __restrict__ mask, int64_t rows, int64_t F, int64_t W,
                                  int32_t* __restrict__ words) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t warp = tid / kGateBits;
  const int lane = static_cast<int>(tid % kGateBits);
  const bool in_range = warp < rows * W;  // uniform per warp (blockDim is a multiple of 32)
  if (!in_range) return;
  const int64_t r = warp / W, w = warp % W;
  const int64_t f = w * kGateBits + lane;
  const bool on = f < F && is_on(mask[r * F + f]);
  const unsigned bits = __ballot_sync(0xffffffffu, on);
  if (lane == 0) words[warp] = static_cast<int32_t>(bits);
}

__global__ void unpack_gates_kernel(const int32_t* __restrict__ words, int64_t rows, int64_t F, int64_t W,
                                    bool* __restrict__ mask) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * F) return;
  const int64_t r = i / F, f = i % F;
  mask[i] = gate_on(words + r * W, f);
}

template <typename T>
cudaError_t launch_pack(const void* mask, int64_t rows, int64_t F, int32_t* words, cudaStream_t stream) {
  const int64_t W = gate_words(F);
  const int64_t threads = rows * W * kGateBits;
  if (threads == 0) return cudaSuccess;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  pack_gates_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const T*>(mask), rows, F, W,
                                                                                words);
  return cudaGetLastError();
}

}  // namespace

cudaError_t pack_gates(const void* mask, MaskType type, int64_t rows, int64_t num_features, int32_t* words,
                       cudaStream_t stream) {
  switch (type) {
    case MaskType::Bool: return launch_pack<bool>(mask, rows, num_features, words, stream);
    case MaskType::Float32: return launch_pack<float>(mask, rows, num_features, words, stream);
    case MaskType::Float64: return launch_pack<double>(mask, rows, num_features, words, stream);
    case MaskType::Float16: return launch_pack<__half>(mask, rows, num_features, words, stream);
    case MaskType::BFloat16: return launch_pack<__nv_bfloat16>(mask, rows, num_features, words, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t unpack_gates(const int32_t* words, int64_t rows, int64_t num_features, bool* mask, cudaStream_t stream) {
  const int64_t n = rows * num_features;
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  unpack_gates_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(words, rows, num_features,
                                                                              gate_words(num_features), mask);
  return cudaGetLastError();
}

}  // namespace ist::cuda
