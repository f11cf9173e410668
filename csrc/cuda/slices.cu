// CUDA kernels for slice_gather / slice_scatter_: one launch for all tensors of a call. Each block
// works on one segment (gather) or one target (scatter), found by a binary search over the plan's
// block starts; threads move aligned vectors (up to 16 bytes) and decompose their position with
// FastDiv (common/slices.h). Memory-bound: the aim is the device's copy bandwidth.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/slices.h"
#include "cuda/slices.cuh"

namespace ist::cuda {
namespace {

// A vector of V elements of T, loaded and stored as one access.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// 16-byte unit for byte copies.
struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <int Bytes>
struct UnitType;
template <> struct UnitType<1> { using type = uint8_t; };
template <> struct UnitType<2> { using type = uint16_t; };
template <> struct UnitType<4> { using type = uint32_t; };
template <> struct UnitType<8> { using type = uint64_t; };
template <> struct UnitType<16> { using type = Bytes16; };

// (q, r) = (n / d, n % d) with FastDiv, or with 64-bit division on the wide path.
__device__ __forceinline__ void divmod(int64_t n, int64_t d, const FastDiv& f, bool wide, int64_t& q, int64_t& r) {
  if (wide) {
    q = n / d;
  } else {
    q = fast_div(f, static_cast<uint32_t>(n));
  }
  r = n - q * d;
}

// Block b belongs to the entry with the largest block_start <= b (entries with no blocks are skipped).
template <typename Entry>
__device__ __forceinline__ int64_t block_entry(const Entry* entries, int64_t count, int64_t b) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (entries[mid].block_start <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---- gather
template <int Unit>
__device__ __forceinline__ void gather_units(const GatherSegment& s, int64_t first) {
  using U = typename UnitType<Unit>::type;
  const U* __restrict__ src = reinterpret_cast<const U*>(s.src);
  U* __restrict__ dst = reinterpret_cast<U*>(s.dst);
  U vals[kGatherUnroll];
#pragma unroll
  for (int r = 0; r < kGatherUnroll; ++r) {
    const int64_t u = first + r * kSliceThreads + threadIdx.x;
    if (u < s.units) {
      int64_t row, c, o, k;
      divmod(u, s.row_units, s.row_div, s.wide, row, c);
      divmod(row, s.n, s.n_div, s.wide, o, k);
      vals[r] = src[(o * s.size + __ldg(s.idx + k)) * s.row_units + c];
    }
  }
#pragma unroll
  for (int r = 0; r < kGatherUnroll; ++r) {
    const int64_t u = first + r * kSliceThreads + threadIdx.x;
    if (u < s.units) dst[u] = vals[r];
  }
}

__global__ void __launch_bounds__(kSliceThreads) slice_gather_kernel(const GatherSegment* __restrict__ segments,
                                                                     int64_t num_segments) {
  __shared__ int64_t seg;
  if (threadIdx.x == 0) seg = block_entry(segments, num_segments, blockIdx.x);
  __syncthreads();
  const GatherSegment s = segments[seg];
  const int64_t first = (static_cast<int64_t>(blockIdx.x) - s.block_start) * (kSliceThreads * kGatherUnroll);
  switch (s.unit) {
    case 16: gather_units<16>(s, first); break;
    case 8: gather_units<8>(s, first); break;
    case 4: gather_units<4>(s, first); break;
    case 2: gather_units<2>(s, first); break;
    default: gather_units<1>(s, first); break;
  }
}

// ---- scatter
template <typename T> struct AccType { using type = std::conditional_t<std::is_integral_v<T>, int64_t, T>; };
template <> struct AccType<__half> { using type = float; };
template <> struct AccType<__nv_bfloat16> { using type = float; };

// Explicit conversions (torch builds with __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__).
template <typename A, typename T> __device__ __forceinline__ A to_acc(T v) { return static_cast<A>(v); }
template <> __device__ __forceinline__ float to_acc<float, __half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_acc<float, __nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T, typename A> __device__ __forceinline__ T from_acc(A v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_acc<__half, float>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) { return __float2bfloat16_rn(v); }

// Reduce the owners of vector u of target t. For copy, T is an unsigned type of the element size.
template <typename T, SliceReduce R, int V>
__device__ __forceinline__ void scatter_vector(const ScatterTarget& t, const ScatterSegment* __restrict__ segments,
                                               int64_t u) {
  using VecT = Vec<T, V>;
  int64_t row, c, o, i;
  divmod(u, t.inner_vecs, t.inner_div, t.wide, row, c);
  divmod(row, t.size, t.size_div, t.wide, o, i);
  VecT* out = reinterpret_cast<VecT*>(t.data) + u;  // the target is contiguous: vector u is row-major position u
  auto owner = [&](const ScatterSegment& s, int32_t p) {
    return reinterpret_cast<const VecT*>(s.update) + ((o * s.n + p) * t.inner_vecs + c);
  };
  if constexpr (R == SliceReduce::Copy) {
    for (int64_t j = t.seg_end - 1; j >= t.seg_begin; --j) {  // the last owner wins
      const int32_t p = __ldg(segments[j].pos + i);
      if (p >= 0) {
        *out = *owner(segments[j], p);
        return;
      }
    }
  } else {
    using A = typename AccType<T>::type;
    constexpr bool kIntegral = std::is_integral_v<T>;
    A acc[V];
    OwnerMean<A, kIntegral> mean[V];
    int64_t k = 0;
    if constexpr (R == SliceReduce::Sum) {
      const VecT x = *out;
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = to_acc<A>(x.v[e]);
    }
    for (int64_t j = t.seg_begin; j < t.seg_end; ++j) {
      const int32_t p = __ldg(segments[j].pos + i);
      if (p < 0) continue;
      const VecT x = *owner(segments[j], p);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A val = to_acc<A>(x.v[e]);
        if constexpr (R == SliceReduce::Sum) {
          acc[e] += val;
        } else if (k == 0) {
          mean[e].begin(val);
        } else {
          mean[e].step(val);
        }
      }
      ++k;
    }
    if (k == 0) return;  // no owner: the target keeps its value
    VecT y;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      if constexpr (R == SliceReduce::Sum) y.v[e] = from_acc<T>(acc[e]);
      else y.v[e] = from_acc<T>(mean[e].finish(k));
    }
    *out = y;
  }
}

template <typename T, SliceReduce R>
__global__ void __launch_bounds__(kSliceThreads) slice_scatter_kernel(const ScatterTarget* __restrict__ targets,
                                                                      int64_t num_targets,
                                                                      const ScatterSegment* __restrict__ segments) {
  __shared__ int64_t target;
  if (threadIdx.x == 0) target = block_entry(targets, num_targets, blockIdx.x);
  __syncthreads();
  const ScatterTarget t = targets[target];
  const int64_t first = (static_cast<int64_t>(blockIdx.x) - t.block_start) * (kSliceThreads * kScatterUnroll);
  constexpr int kVec = sizeof(T) >= 16 ? 1 : 16 / static_cast<int>(sizeof(T));
#pragma unroll
  for (int r = 0; r < kScatterUnroll; ++r) {
    const int64_t u = first + r * kSliceThreads + threadIdx.x;
    if (u >= t.vecs) break;
    if (t.vec == 1) scatter_vector<T, R, 1>(t, segments, u);
    else scatter_vector<T, R, kVec>(t, segments, u);
  }
}

template <typename T, SliceReduce R>
cudaError_t launch_scatter(const ScatterTarget* targets, int64_t num_targets, const ScatterSegment* segments,
                           int64_t num_blocks, cudaStream_t stream) {
  slice_scatter_kernel<T, R><<<static_cast<unsigned>(num_blocks), kSliceThreads, 0, stream>>>(targets, num_targets,
                                                                                               segments);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_reduce(const ScatterTarget* targets, int64_t num_targets, const ScatterSegment* segments,
                          int64_t num_blocks, SliceReduce reduce, cudaStream_t stream) {
  if (reduce == SliceReduce::Sum) return launch_scatter<T, SliceReduce::Sum>(targets, num_targets, segments, num_blocks, stream);
  return launch_scatter<T, SliceReduce::Mean>(targets, num_targets, segments, num_blocks, stream);
}

}  // namespace

cudaError_t slice_gather(const GatherSegment* segments, int64_t num_segments, int64_t num_blocks,
                         cudaStream_t stream) {
  if (num_blocks == 0 || num_segments == 0) return cudaSuccess;
  slice_gather_kernel<<<static_cast<unsigned>(num_blocks), kSliceThreads, 0, stream>>>(segments, num_segments);
  return cudaGetLastError();
}

cudaError_t slice_scatter(const ScatterTarget* targets, int64_t num_targets, const ScatterSegment* segments,
                          int64_t num_blocks, SliceReduce reduce, ScalarKind kind, int64_t element_size,
                          cudaStream_t stream) {
  if (num_blocks == 0 || num_targets == 0) return cudaSuccess;
  if (reduce == SliceReduce::Copy) {
    switch (element_size) {
      case 1: return launch_scatter<uint8_t, SliceReduce::Copy>(targets, num_targets, segments, num_blocks, stream);
      case 2: return launch_scatter<uint16_t, SliceReduce::Copy>(targets, num_targets, segments, num_blocks, stream);
      case 4: return launch_scatter<uint32_t, SliceReduce::Copy>(targets, num_targets, segments, num_blocks, stream);
      case 8: return launch_scatter<uint64_t, SliceReduce::Copy>(targets, num_targets, segments, num_blocks, stream);
      case 16: return launch_scatter<Bytes16, SliceReduce::Copy>(targets, num_targets, segments, num_blocks, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (kind) {
    case ScalarKind::Float32: return launch_reduce<float>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::Float64: return launch_reduce<double>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::Float16: return launch_reduce<__half>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::BFloat16:
      return launch_reduce<__nv_bfloat16>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::Int64: return launch_reduce<int64_t>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::Int32: return launch_reduce<int32_t>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::Int16: return launch_reduce<int16_t>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::Int8: return launch_reduce<int8_t>(targets, num_targets, segments, num_blocks, reduce, stream);
    case ScalarKind::UInt8: return launch_reduce<uint8_t>(targets, num_targets, segments, num_blocks, reduce, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ist::cuda
