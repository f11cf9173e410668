// CUDA kernels for slice_gather / slice_scatter_: one launch for all tensors of a call. Each block
// works on one segment (gather) or one target (scatter), found by a binary search over the plan's
// block starts. A thread moves items of `store` bytes of the layout it writes as `store / unit`
// loads of `unit` bytes (slices.cuh), walking rows with a RowCursor (common/slice_cursor.h): one
// division per item, none per load. Memory-bound: the aim is the device's copy bandwidth, so every
// load of an item (and, in the scatter, of every owner of a chunk) is issued before any is used.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/slice_cursor.h"
#include "common/slices.h"
#include "cuda/slices.cuh"

namespace ist::cuda {
namespace {

// N values of T moved as one access of sizeof(T) * N bytes.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// 16-byte unit for byte copies.
struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <int Bytes> struct UnitType;
template <> struct UnitType<1> { using type = uint8_t; };
template <> struct UnitType<2> { using type = uint16_t; };
template <> struct UnitType<4> { using type = uint32_t; };
template <> struct UnitType<8> { using type = uint64_t; };
template <> struct UnitType<16> { using type = Bytes16; };

// Addresses read from a plan table are generic; telling the compiler they are global lets it emit
// LDG / STG (and the vector forms LDG.E.128 / STG.E.128) instead of generic LD / ST.
template <typename P>
__device__ __forceinline__ P global(P p) {
  __builtin_assume(__isGlobal(p));
  return p;
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

// Run body.template operator()<U, D>() for the (unit, store) pair of an entry: (unit, unit) for
// units in [Min, Max]; (unit, Max) for units in [Min, Max) when SplitAny, else only (Min, Max)
// (slices.cuh: the pairs the binding may choose).
template <int Min, int Max, bool SplitAny, typename Body>
__device__ __forceinline__ void with_widths(int unit, int store, Body&& body) {
  auto run = [&]<int U>() {
    if constexpr (U >= Min && U <= Max) {
      if (store == unit) {
        body.template operator()<U, U>();
      } else if constexpr (U < Max && (SplitAny || U == Min)) {
        body.template operator()<U, Max>();
      }
    }
  };
  switch (unit) {
    case 16: run.template operator()<16>(); break;
    case 8: run.template operator()<8>(); break;
    case 4: run.template operator()<4>(); break;
    case 2: run.template operator()<2>(); break;
    default: run.template operator()<1>(); break;
  }
}

// ---- gather: item w of a segment is bytes [w * D, (w + 1) * D) of its compact output.
template <int U, int D>
__device__ __forceinline__ void gather_items(const GatherSegment& s, int64_t first) {
  using Load = typename UnitType<U>::type;
  constexpr int L = D / U;
  constexpr int I = gather_items_per_thread(L);
  const Load* __restrict__ src = reinterpret_cast<const Load*>(global(s.src));
  Pack<Load, L> vals[I];
#pragma unroll
  for (int it = 0; it < I; ++it) {
    const int64_t w = first + it * kSliceThreads + threadIdx.x;
    if (w < s.items) {
      RowCursor cur(w * L, s.row_units, s.n, s.row_div, s.n_div, s.wide);
      const Load* row = src + (cur.o * s.size + __ldg(s.idx + cur.k)) * s.row_units;
#pragma unroll
      for (int l = 0; l < L; ++l) {
        vals[it].v[l] = row[cur.c];
        if (l + 1 < L && cur.next(s.row_units, s.n)) row = src + (cur.o * s.size + __ldg(s.idx + cur.k)) * s.row_units;
      }
    }
  }
  auto* __restrict__ dst = reinterpret_cast<Pack<Load, L>*>(global(s.dst));
#pragma unroll
  for (int it = 0; it < I; ++it) {
    const int64_t w = first + it * kSliceThreads + threadIdx.x;
    if (w < s.items) dst[w] = vals[it];
  }
}

__global__ void __launch_bounds__(kSliceThreads) slice_gather_kernel(const GatherSegment* __restrict__ segments,
                                                                     int64_t num_segments) {
  __shared__ int64_t seg;
  if (threadIdx.x == 0) seg = block_entry(segments, num_segments, blockIdx.x);
  __syncthreads();
  const GatherSegment s = segments[seg];
  const int64_t block = static_cast<int64_t>(blockIdx.x) - s.block_start;
  with_widths<1, 16, true>(s.unit, s.store, [&]<int U, int D>() {
    gather_items<U, D>(s, block * kSliceThreads * gather_items_per_thread(D / U));
  });
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

// Owners (segments) whose positions and values one pass loads before reducing any of them.
constexpr int owner_chunk(int loads_per_item) { return loads_per_item >= 4 ? 2 : 4; }

// Item w of target t: bytes [w * D, (w + 1) * D) of the target, L loads of U bytes (V elements) each.
// Owners are visited in segment order, a chunk at a time: every position, then every value of
// the chunk is loaded before the reduction reads one. For copy, T is an unsigned type of the
// element size.
template <typename T, SliceReduce R, int U, int D>
__device__ __forceinline__ void scatter_item(const ScatterTarget& t, const ScatterSegment* __restrict__ segments,
                                             int64_t w) {
  constexpr int V = U / static_cast<int>(sizeof(T));
  constexpr int L = D / U;
  constexpr int C = owner_chunk(L);
  using Unit = Pack<T, V>;
  using Item = Pack<T, V * L>;
  // (o, i, c) of each load
  int64_t o[L], c[L];
  int32_t i[L];
  RowCursor cur(w * L, t.row_units, t.size, t.row_div, t.size_div, t.wide);
#pragma unroll
  for (int l = 0; l < L; ++l) {
    o[l] = cur.o;
    i[l] = static_cast<int32_t>(cur.k);
    c[l] = cur.c;
    if (l + 1 < L) cur.next(t.row_units, t.size);
  }
  Item* out = reinterpret_cast<Item*>(global(t.data)) + w;
  auto owner = [&](const ScatterSegment& s, int32_t p, int l) {
    return reinterpret_cast<const Unit*>(global(s.update)) + ((o[l] * s.n + p) * t.row_units + c[l]);
  };
  // The positions of this item's loads in segments j0 .. j0 + C - 1 (-1: not owned or past the end),
  // all issued before any is used.
  auto positions = [&](int64_t j0, int32_t (&p)[C][L]) {
#pragma unroll
    for (int q = 0; q < C; ++q)
#pragma unroll
      for (int l = 0; l < L; ++l) p[q][l] = j0 + q < t.seg_end ? __ldg(segments[j0 + q].pos + i[l]) : -1;
  };
  auto put = [](Item& y, int l, const Unit& x) {
#pragma unroll
    for (int e = 0; e < V; ++e) y.v[l * V + e] = x.v[e];
  };

  if constexpr (R == SliceReduce::Copy) {
    int32_t best_p[L];
    int64_t best_j[L];
#pragma unroll
    for (int l = 0; l < L; ++l) best_p[l] = -1, best_j[l] = 0;
    for (int64_t j0 = t.seg_begin; j0 < t.seg_end; j0 += C) {
      int32_t p[C][L];
      positions(j0, p);
#pragma unroll
      for (int q = 0; q < C; ++q)
#pragma unroll
        for (int l = 0; l < L; ++l)
          if (p[q][l] >= 0) best_p[l] = p[q][l], best_j[l] = j0 + q;  // the last owner wins
    }
    bool any = false, all = true;
#pragma unroll
    for (int l = 0; l < L; ++l) any |= best_p[l] >= 0, all &= best_p[l] >= 0;
    if (!any) return;
    Item y;
    if (!all) y = *out;  // slices without an owner keep their value
#pragma unroll
    for (int l = 0; l < L; ++l)
      if (best_p[l] >= 0) put(y, l, *owner(segments[best_j[l]], best_p[l], l));
    *out = y;
  } else {
    using A = typename AccType<T>::type;
    constexpr bool kIntegral = std::is_integral_v<T>;
    A acc[L][V];
    OwnerMean<A, kIntegral> mean[L][V];  // common/slices.h: overflow-safe, bit-exact for equal owners
    int32_t k[L];
    Item x0;
    if constexpr (R == SliceReduce::Sum) x0 = *out;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      k[l] = 0;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        acc[l][e] = R == SliceReduce::Sum ? to_acc<A>(x0.v[l * V + e]) : A(0);
      }
    }
    for (int64_t j0 = t.seg_begin; j0 < t.seg_end; j0 += C) {
      int32_t p[C][L];
      Unit x[C][L];
      positions(j0, p);
#pragma unroll
      for (int q = 0; q < C; ++q)
#pragma unroll
        for (int l = 0; l < L; ++l)
          if (p[q][l] >= 0) x[q][l] = *owner(segments[j0 + q], p[q][l], l);
#pragma unroll
      for (int q = 0; q < C; ++q)
#pragma unroll
        for (int l = 0; l < L; ++l) {
          if (p[q][l] < 0) continue;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const A val = to_acc<A>(x[q][l].v[e]);
            if constexpr (R == SliceReduce::Sum) {
              acc[l][e] += val;
            } else if (k[l] == 0) {
              mean[l][e].begin(val);
            } else {
              mean[l][e].step(val);
            }
          }
          ++k[l];
        }
    }
    bool any = false, all = true;
#pragma unroll
    for (int l = 0; l < L; ++l) any |= k[l] > 0, all &= k[l] > 0;
    if (!any) return;  // no owner: the target keeps its value
    if constexpr (R == SliceReduce::Mean) {
      if (!all) x0 = *out;
    }
    Item y = x0;  // loads without an owner keep the target's bits
#pragma unroll
    for (int l = 0; l < L; ++l) {
      if (k[l] == 0) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if constexpr (R == SliceReduce::Sum) y.v[l * V + e] = from_acc<T>(acc[l][e]);
        else y.v[l * V + e] = from_acc<T>(mean[l][e].finish(k[l]));
      }
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
  const int64_t block = static_cast<int64_t>(blockIdx.x) - t.block_start;
  with_widths<static_cast<int>(sizeof(T)), scatter_max_unit(sizeof(T)), false>(t.unit, t.store, [&]<int U, int D>() {
    constexpr int I = scatter_items_per_thread(D / U);
    const int64_t first = block * kSliceThreads * I;
#pragma unroll
    for (int it = 0; it < I; ++it) {
      const int64_t w = first + it * kSliceThreads + threadIdx.x;
      if (w < t.items) scatter_item<T, R, U, D>(t, segments, w);
    }
  });
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
