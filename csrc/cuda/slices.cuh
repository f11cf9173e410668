#pragma once
// CUDA kernels for the multi-tensor slice ops. Toolkit-only interface: the binding
// (csrc/cuda/slices_binding.cpp) builds the plan tables below on the host, copies them to the
// device in one transfer and passes their device address; each op is then one kernel launch for
// all tensors of the call. Index math: common/slices.h.
#include <cstdint>

#include <cuda_runtime.h>

#include "common/slices.h"

namespace ist::cuda {

// Threads per block, and units each thread moves (the work of one block is kThreads * kUnroll units).
constexpr int kSliceThreads = 256;
constexpr int kGatherUnroll = 4;
constexpr int kScatterUnroll = 2;

// One gather segment: the compact [outer, n, inner] copy of slices idx[0..n) of a contiguous
// [outer, size, inner] source, moved in units of `unit` bytes (1, 2, 4, 8 or 16: a power of two that
// divides a row's bytes and aligns the source and the destination). A row holds row_units units.
struct GatherSegment {
  const char* src;
  char* dst;             // the segment's first byte in the output
  const int64_t* idx;    // device copy of the index list
  int64_t units;         // outer * n * row_units
  int64_t size;          // source slices along dim
  int64_t row_units;
  int64_t n;
  int64_t block_start;   // first block of this segment (blocks cover kSliceThreads * kGatherUnroll units)
  FastDiv row_div;       // divides by row_units (valid when !wide)
  FastDiv n_div;         // divides by n (valid when !wide)
  int32_t unit;          // bytes per unit
  int32_t wide;          // 1: units >= 2^31, plain 64-bit division
};

// One target of a scatter: a contiguous tensor [outer, size, inner] processed in vectors of `vec`
// elements (vec divides inner; the target and every owner's update are aligned to a vector).
struct ScatterTarget {
  char* data;
  int64_t vecs;          // numel / vec
  int64_t size;          // slices along dim
  int64_t inner_vecs;    // inner / vec
  int64_t block_start;   // first block of this target (blocks cover kSliceThreads * kScatterUnroll vectors)
  int64_t seg_begin;     // its segments: segments[seg_begin .. seg_end), in segment order
  int64_t seg_end;
  FastDiv inner_div;     // divides by inner_vecs (valid when !wide)
  FastDiv size_div;      // divides by size (valid when !wide)
  int32_t vec;           // 1, or 16 / element size
  int32_t wide;          // 1: vecs >= 2^31, plain 64-bit division
};

// One segment of a scatter: the compact update [outer, n, inner] and the inverse map of its index
// list (pos[i] = position of slice i in the update, or -1).
struct ScatterSegment {
  const char* update;
  const int32_t* pos;
  int64_t n;
};

// Element types of the sum / mean reductions; copy moves bytes and needs only the element size.
enum class ScalarKind : int { Float32, Float64, Float16, BFloat16, Int64, Int32, Int16, Int8, UInt8 };

// out = every segment, flattened and concatenated. `segments` is a device array; num_blocks is the
// sum of the segments' blocks (the last segment's block_start + its blocks).
cudaError_t slice_gather(const GatherSegment* segments, int64_t num_segments, int64_t num_blocks,
                         cudaStream_t stream);

// Every vector of every target: reduce its owners (the target's segments with pos[i] >= 0, in
// order) into it; vectors without owners are not touched. `kind` is used for sum / mean,
// `element_size` for copy.
cudaError_t slice_scatter(const ScatterTarget* targets, int64_t num_targets, const ScatterSegment* segments,
                          int64_t num_blocks, SliceReduce reduce, ScalarKind kind, int64_t element_size,
                          cudaStream_t stream);

}  // namespace ist::cuda
