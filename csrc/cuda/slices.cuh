#pragma once
// CUDA kernels for the multi-tensor slice ops. Toolkit-only interface: the binding
// (csrc/cuda/slices_binding.cpp) builds the plan tables below on the host, copies them to the
// device in one asynchronous transfer and passes their device address; each op is then one kernel
// launch for all tensors of the call. Index math: common/slices.h, common/slice_cursor.h.
//
// Widths. Every thread moves `items` of `store` bytes of the layout it writes (the compact output of
// a gather, the full target of a scatter), each item as `store / unit` loads of `unit` bytes from
// the layout it reads. `unit` (1, 2, 4, 8 or 16) is the widest power of two that divides a row's
// bytes and aligns every base address; `store` is 16 (the scatter: scatter_max_unit) where the
// written range and its base allow that vector, else `unit`: the 36-byte rows of a 3x3 conv sliced
// along dim 1 move as 4-byte loads and 16-byte stores.
#include <cstdint>

#include <cuda_runtime.h>

#include "common/slices.h"

namespace ist::cuda {

constexpr int kSliceThreads = 256;

// Items per thread (independent loads in flight): about 8 loads, at most 4 items.
constexpr int gather_items_per_thread(int loads_per_item) {
  return loads_per_item >= 8 ? 1 : (loads_per_item >= 4 ? 2 : 4);
}
constexpr int scatter_items_per_thread(int loads_per_item) { return loads_per_item == 1 ? 2 : 1; }

// One gather segment: the compact [outer, n, inner] copy of slices idx[0..n) of a contiguous
// [outer, size, inner] source. A row holds row_units units of `unit` bytes.
struct GatherSegment {
  const char* src;
  char* dst;             // the segment's first byte in the output
  const int64_t* idx;    // device copy of the index list
  int64_t units;         // outer * n * row_units
  int64_t items;         // units * unit / store
  int64_t size;          // source slices along dim
  int64_t row_units;
  int64_t n;
  int64_t block_start;   // first block of this segment
  FastDiv row_div;       // divides by row_units (valid when !wide)
  FastDiv n_div;         // divides by n (valid when !wide)
  int32_t unit;          // bytes per load
  int32_t store;         // bytes per store: unit, or 16
  int32_t wide;          // 1: units >= 2^31, plain 64-bit division
};

// One target of a scatter: a contiguous tensor [outer, size, inner], rows of row_units units.
struct ScatterTarget {
  char* data;
  int64_t units;         // numel * element_size / unit
  int64_t items;         // units * unit / store
  int64_t size;          // slices along dim
  int64_t row_units;
  int64_t block_start;   // first block of this target
  int64_t seg_begin;     // its segments: segments[seg_begin .. seg_end), in segment order
  int64_t seg_end;
  FastDiv row_div;       // divides by row_units (valid when !wide)
  FastDiv size_div;      // divides by size (valid when !wide)
  int32_t unit;          // bytes per load (>= the element size)
  int32_t store;         // bytes per store: unit, or 16
  int32_t wide;          // 1: units >= 2^31, plain 64-bit division
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

// (unit, store) pairs the kernels are built for; the binding picks among these.
constexpr bool gather_width_supported(int unit, int store) {
  return (unit == 1 || unit == 2 || unit == 4 || unit == 8 || unit == 16) && (store == unit || store == 16);
}
// Scatter: loads of at most 4 elements (the reductions hold every owner's values of a chunk in
// registers; 16 int8 accumulators per load would spill): units from the element size to
// scatter_max_unit with store == unit, and (element size, scatter_max_unit).
constexpr int scatter_max_unit(int element_size) { return element_size >= 4 ? 16 : 4 * element_size; }
constexpr bool scatter_width_supported(int element_size, int unit, int store) {
  return unit >= element_size && unit <= scatter_max_unit(element_size) && (unit & (unit - 1)) == 0 &&
         (store == unit || (store == scatter_max_unit(element_size) && unit == element_size));
}

// out = every segment, flattened and concatenated. `segments` is a device array; num_blocks is the
// sum of the segments' blocks.
cudaError_t slice_gather(const GatherSegment* segments, int64_t num_segments, int64_t num_blocks,
                         cudaStream_t stream);

// Every item of every target: reduce its owners (the target's segments with pos[i] >= 0, in order)
// into it; slices without owners keep their value. `kind` is used for sum / mean, `element_size`
// for copy.
cudaError_t slice_scatter(const ScatterTarget* targets, int64_t num_targets, const ScatterSegment* segments,
                          int64_t num_blocks, SliceReduce reduce, ScalarKind kind, int64_t element_size,
                          cudaStream_t stream);

}  // namespace ist::cuda
