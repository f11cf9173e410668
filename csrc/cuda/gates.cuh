#pragma once
// CUDA kernels for 1-bit gates. Toolkit-only interface (raw pointers + a stream) so the .cu file
// compiles with plain `nvcc -c`; csrc/cuda/gates_binding.cpp adapts it to torch.
#include <cstdint>

#include <cuda_runtime.h>

namespace ist::cuda {

// Element type of a gate mask (what pack_gates reads).
enum class MaskType : int { Bool = 0, Float32 = 1, Float64 = 2, Float16 = 3, BFloat16 = 4 };

// words[r, w] = pack(mask[r, 32w : 32w+32] > 0), mask row-major [rows, num_features].
cudaError_t pack_gates(const void* mask, MaskType type, int64_t rows, int64_t num_features, int32_t* words,
                       cudaStream_t stream);

// mask[r, f] = bit f of words[r, :], words row-major [rows, gate_words(num_features)].
cudaError_t unpack_gates(const int32_t* words, int64_t rows, int64_t num_features, bool* mask, cudaStream_t stream);

}  // namespace ist::cuda
