#pragma once
// Argument checks and host-side plans of the multi-tensor slice ops, shared by the CPU kernels
// (csrc/cpu/slices.cpp) and the CUDA binding (csrc/cuda/slices_binding.cpp). Every check runs
// before anything is written; every message names the op and the argument. The index math itself
// is in common/slices.h; index-list validation in common/indices.h.
//
// Costs of the conveniences (all O(1) launches or copies per call, none per element on the hot path):
//  - index lists living on a CUDA device are concatenated and copied to the host once (one sync) to
//    validate them and build the plan; lists already on the CPU cost no sync;
//  - a non-contiguous source, update or target is made contiguous once (a full copy of that tensor;
//    for a target, a second copy writes the result back). Parameters and the compact updates the
//    gather produces are contiguous, so the usual path copies nothing.
#include <ATen/MemoryOverlap.h>
#include <torch/all.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "checks.h"
#include "common/indices.h"
#include "common/slices.h"

namespace ist {

// ---- index lists, validated and readable on the host
struct HostIndices {
  std::vector<at::Tensor> keep;     // host tensors that own the data below
  std::vector<const int64_t*> ptr;  // ptr[j]: host pointer to index list j
  std::vector<int64_t> len;         // len[j]: its length

  HostIndices() = default;
  // Index lists must be int64 and 1-D, on the CPU or on `device`. Lists on a CUDA device are
  // concatenated there and copied to the host in one transfer.
  HostIndices(at::TensorList indices, const at::Device& device, const char* op) {
    const int64_t J = static_cast<int64_t>(indices.size());
    std::vector<at::Tensor> remote;
    for (int64_t j = 0; j < J; ++j) {
      const auto& t = indices[j];
      TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": indices[", j, "] must be int64, got ", t.scalar_type());
      TORCH_CHECK_VALUE(t.dim() == 1, op, ": indices[", j, "] must be 1-D, got ", t.dim(), " dimensions");
      TORCH_CHECK_VALUE(t.device().is_cpu() || t.device() == device, op, ": indices[", j, "] is on ", t.device(),
                        " but the tensors are on ", device, "; index lists must be on the CPU",
                        device.is_cpu() ? "" : " or on the tensors' device");
      if (!t.device().is_cpu()) remote.push_back(t);
    }
    at::Tensor fetched;
    if (!remote.empty()) fetched = at::cat(remote).to(at::kCPU);
    ptr.resize(J);
    len.resize(J);
    int64_t at_remote = 0;
    for (int64_t j = 0; j < J; ++j) {
      const auto& t = indices[j];
      len[j] = t.numel();
      if (t.device().is_cpu()) {
        keep.push_back(t.contiguous());
        ptr[j] = keep.back().const_data_ptr<int64_t>();
      } else {
        ptr[j] = fetched.const_data_ptr<int64_t>() + at_remote;
        at_remote += len[j];
      }
    }
    if (fetched.defined()) keep.push_back(fetched);
  }

  // In range [0, size) and no value twice (common/indices.h). `what` names the dimension, e.g.
  // "sources[2] along dim 1"; `bitmap` is scratch reused across lists.
  void check_values(int64_t j, int64_t size, const std::string& what, const char* op,
                    std::vector<uint32_t>& bitmap) const {
    bitmap.assign(static_cast<size_t>(index_bitmap_words(size)), 0u);
    const IndexCheck r = check_indices(ptr[j], len[j], size, bitmap.data());
    const std::string name = "indices[" + std::to_string(j) + "]";
    TORCH_CHECK_INDEX(r.status != IndexStatus::kOutOfRange, op, ": ", name, "[", r.position, "] = ", r.value,
                      " is out of range for ", what, " of size ", size);
    TORCH_CHECK_VALUE(r.status != IndexStatus::kDuplicate, op, ": ", name, " must not repeat an index, but ", name,
                      "[", r.position, "] = ", r.value, " repeats ", name, "[", r.first,
                      "]; a segment holds each slice at most once");
  }
};

inline std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t d = 0; d < s.size(); ++d) out += (d ? ", " : "") + std::to_string(s[d]);
  return out + "]";
}

// Tensors sliced along one dim each: one dtype, one device, at least 1-D, dims wrapped.
inline std::vector<int64_t> check_sliced_tensors(at::TensorList ts, at::IntArrayRef dims, const char* op,
                                                 const char* name) {
  TORCH_CHECK_VALUE(dims.size() == ts.size(), op, ": dims must have one entry per ", name, " (", ts.size(), "), got ",
                    dims.size());
  std::vector<int64_t> wrapped(ts.size());
  for (size_t t = 0; t < ts.size(); ++t) {
    TORCH_CHECK_TYPE(ts[t].scalar_type() == ts[0].scalar_type(), op, ": ", name, "[", t, "] has dtype ",
                     ts[t].scalar_type(), " but ", name, "[0] has ", ts[0].scalar_type(),
                     "; all ", name, " must share one dtype (the functional wrappers group mixed dtypes)");
    TORCH_CHECK_VALUE(ts[t].device() == ts[0].device(), op, ": ", name, "[", t, "] is on ", ts[t].device(),
                      " but ", name, "[0] is on ", ts[0].device(), "; all tensors must be on one device");
    const int64_t nd = ts[t].dim();
    TORCH_CHECK_VALUE(nd >= 1, op, ": ", name, "[", t, "] is 0-d; a sliced tensor needs at least 1 dimension");
    TORCH_CHECK_INDEX(dims[t] >= -nd && dims[t] < nd, op, ": dims[", t, "] = ", dims[t], " is out of range for ",
                      name, "[", t, "] with ", nd, " dimensions");
    wrapped[t] = dims[t] < 0 ? dims[t] + nd : dims[t];
    TORCH_CHECK_VALUE(ts[t].size(wrapped[t]) <= kFastDivMax, op, ": ", name, "[", t, "] has ", ts[t].size(wrapped[t]),
                      " slices along dim ", wrapped[t], "; at most 2^31 - 1 are supported");
  }
  return wrapped;
}

inline void check_ids(at::IntArrayRef ids, int64_t count, const char* op, const char* ids_name, const char* name) {
  for (size_t j = 0; j < ids.size(); ++j)
    TORCH_CHECK_INDEX(ids[j] >= 0 && ids[j] < count, op, ": ", ids_name, "[", j, "] = ", ids[j],
                      " is out of range: there are ", count, " ", name);
}

inline SliceView view_of(const at::Tensor& t, int64_t dim) {
  return slice_view(t.sizes().data(), t.dim(), dim);
}

// ---- A round's plan, built and validated once (slice_plan), read by every slice_plan_gather_ /
// slice_plan_scatter_ of the round: one int64 CPU tensor holding the tensors' shapes, every
// segment's index list and offset, and the scatter's owners (active targets, their segments in
// order, owned slices, inverse maps). Offsets are in int64 words from the start of the tensor.
enum PlanField : int64_t {
  kMagic, kTensors, kSegments, kTotal, kActive, kDtype, kDeviceType, kDeviceIndex,
  kShapes,    // T offsets, each to [ndim, dim, size_0 .. size_{ndim-1}]
  kSegs,      // J records [tensor, n, offset (gather elements), index list (word offset)]
  kTargets,   // A + 1 records [tensor, first of its segments in kSegOrder, first of its owned slices]
  kSegOrder,  // J segment ids, grouped by target, in segment order within a target
  kPosOffset, // J offsets into kPos (int32 units)
  kOwned,     // slices with >= 1 owner, ascending within a target
  kIndices,   // the index lists
  kPos,       // int32 inverse maps, two per word
  kPosCount,
  kHeader
};
constexpr int64_t kPlanMagic = 0x49535450;  // "ISTP"

struct PlanView {
  const int64_t* m;

  PlanView(const at::Tensor& plan, const char* op) {
    TORCH_CHECK_VALUE(plan.device().is_cpu() && plan.scalar_type() == at::kLong && plan.dim() == 1 &&
                          plan.is_contiguous() && plan.numel() >= kHeader,
                      op, ": plan must be the int64 CPU tensor slice_plan returns");
    m = plan.const_data_ptr<int64_t>();
    TORCH_CHECK_VALUE(m[kMagic] == kPlanMagic, op, ": plan must be the int64 CPU tensor slice_plan returns");
  }
  int64_t tensors() const { return m[kTensors]; }
  int64_t segments() const { return m[kSegments]; }
  int64_t total() const { return m[kTotal]; }
  int64_t active() const { return m[kActive]; }
  at::ScalarType dtype() const { return static_cast<at::ScalarType>(m[kDtype]); }
  at::Device device() const {
    return at::Device(static_cast<at::DeviceType>(m[kDeviceType]), static_cast<at::DeviceIndex>(m[kDeviceIndex]));
  }
  const int64_t* shape_record(int64_t t) const { return m + m[m[kShapes] + t]; }  // [ndim, dim, sizes...]
  int64_t dim(int64_t t) const { return shape_record(t)[1]; }
  at::IntArrayRef shape(int64_t t) const {
    const int64_t* r = shape_record(t);
    return at::IntArrayRef(r + 2, static_cast<size_t>(r[0]));
  }
  const int64_t* seg(int64_t j) const { return m + m[kSegs] + 4 * j; }
  const int64_t* target(int64_t a) const { return m + m[kTargets] + 3 * a; }
  const int64_t* seg_order() const { return m + m[kSegOrder]; }
  const int64_t* pos_offset() const { return m + m[kPosOffset]; }
  const int64_t* owned() const { return m + m[kOwned]; }
  const int32_t* pos() const { return reinterpret_cast<const int32_t*>(m + m[kPos]); }
  int64_t pos_count() const { return m[kPosCount]; }
};

// The per-call checks of a planned op: the tensors are the ones the plan was built for (count,
// dtype, device, shape). O(tensors x dims); the index values were checked once, at build.
inline void check_plan_tensors(const PlanView& p, at::TensorList ts, const char* op, const char* name) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(ts.size()) == p.tensors(), op, ": the plan was built for ", p.tensors(),
                    " tensors, got ", ts.size(), " ", name);
  for (size_t t = 0; t < ts.size(); ++t) {
    TORCH_CHECK_TYPE(ts[t].scalar_type() == p.dtype(), op, ": ", name, "[", t, "] has dtype ", ts[t].scalar_type(),
                     " but the plan was built for ", p.dtype());
    TORCH_CHECK_VALUE(ts[t].device() == p.device(), op, ": ", name, "[", t, "] is on ", ts[t].device(),
                      " but the plan was built for ", p.device());
    TORCH_CHECK_VALUE(ts[t].sizes() == p.shape(static_cast<int64_t>(t)), op, ": ", name, "[", t, "] has shape ",
                      shape_str(ts[t].sizes()), " but the plan was built for ", shape_str(p.shape(static_cast<int64_t>(t))));
  }
}

// slice_plan: validate a round's slices once (everything slice_gather / slice_scatter_ check,
// index values included) and lay them out as above.
inline at::Tensor build_slice_plan(at::TensorList tensors, at::IntArrayRef ids, at::TensorList indices,
                                   at::IntArrayRef dims, const char* op) {
  TORCH_CHECK_VALUE(!tensors.empty(), op, ": tensors is empty; give at least one tensor");
  TORCH_CHECK_VALUE(ids.size() == indices.size(), op, ": ids and indices must have one entry per segment, got ",
                    ids.size(), " and ", indices.size());
  const auto d = check_sliced_tensors(tensors, dims, op, "tensors");
  const int64_t T = static_cast<int64_t>(tensors.size());
  check_ids(ids, T, op, "ids", "tensors");
  const int64_t J = static_cast<int64_t>(ids.size());
  const HostIndices idx(indices, tensors[0].device(), op);
  std::vector<uint32_t> seen;
  for (int64_t j = 0; j < J; ++j) {
    const int64_t t = ids[j];
    idx.check_values(j, tensors[t].size(d[t]), "tensors[" + std::to_string(t) + "] along dim " + std::to_string(d[t]),
                     op, seen);
  }
  std::vector<int64_t> m(kHeader, 0);
  auto here = [&] { return static_cast<int64_t>(m.size()); };
  m[kMagic] = kPlanMagic;
  m[kTensors] = T;
  m[kSegments] = J;
  m[kDtype] = static_cast<int64_t>(tensors[0].scalar_type());
  m[kDeviceType] = static_cast<int64_t>(tensors[0].device().type());
  m[kDeviceIndex] = tensors[0].device().has_index() ? tensors[0].device().index() : -1;
  m[kShapes] = here();
  m.resize(m.size() + T);
  for (int64_t t = 0; t < T; ++t) {
    m[m[kShapes] + t] = here();
    m.push_back(tensors[t].dim());
    m.push_back(d[t]);
    for (const auto s : tensors[t].sizes()) m.push_back(s);
  }
  m[kSegs] = here();
  int64_t offset = 0;
  for (int64_t j = 0; j < J; ++j) {
    m.insert(m.end(), {ids[j], idx.len[j], offset, 0});
    offset += segment_numel(view_of(tensors[ids[j]], d[ids[j]]), idx.len[j]);
  }
  m[kTotal] = offset;
  // The scatter's owners: active targets in ascending order, their segments in segment order.
  std::vector<std::vector<int64_t>> segs_of(T);
  for (int64_t j = 0; j < J; ++j) segs_of[ids[j]].push_back(j);
  std::vector<int64_t> order, pos_offset(J), owned, active;
  std::vector<int32_t> pos;
  int64_t pos_total = 0;
  for (int64_t j = 0; j < J; ++j) pos_total += tensors[ids[j]].size(d[ids[j]]);
  pos.reserve(static_cast<size_t>(pos_total));
  std::vector<int64_t> seg_begin{0}, owned_begin{0};
  for (int64_t t = 0; t < T; ++t) {
    if (segs_of[t].empty()) continue;
    active.push_back(t);
    const int64_t size = tensors[t].size(d[t]);
    std::vector<uint8_t> any(size, 0);
    for (const int64_t j : segs_of[t]) {
      order.push_back(j);
      pos_offset[j] = static_cast<int64_t>(pos.size());
      pos.resize(pos.size() + size, -1);
      fill_inverse_map(idx.ptr[j], idx.len[j], pos.data() + pos_offset[j]);
      for (int64_t k = 0; k < idx.len[j]; ++k) any[idx.ptr[j][k]] = 1;
    }
    for (int64_t i = 0; i < size; ++i)
      if (any[i]) owned.push_back(i);
    seg_begin.push_back(static_cast<int64_t>(order.size()));
    owned_begin.push_back(static_cast<int64_t>(owned.size()));
  }
  const int64_t A = static_cast<int64_t>(active.size());
  m[kActive] = A;
  m[kTargets] = here();
  for (int64_t a = 0; a <= A; ++a) m.insert(m.end(), {a < A ? active[a] : -1, seg_begin[a], owned_begin[a]});
  m[kSegOrder] = here();
  m.insert(m.end(), order.begin(), order.end());
  m[kPosOffset] = here();
  m.insert(m.end(), pos_offset.begin(), pos_offset.end());
  m[kOwned] = here();
  m.insert(m.end(), owned.begin(), owned.end());
  // The large parts (index lists, inverse maps) go straight into the result, copied once.
  m[kIndices] = here();
  int64_t at_idx = m[kIndices];
  for (int64_t j = 0; j < J; ++j) {
    m[m[kSegs] + 4 * j + 3] = at_idx;
    at_idx += idx.len[j];
  }
  m[kPos] = at_idx;
  m[kPosCount] = static_cast<int64_t>(pos.size());
  const int64_t words = at_idx + (static_cast<int64_t>(pos.size()) + 1) / 2;
  auto out = at::empty({words}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  std::memcpy(o, m.data(), m.size() * sizeof(int64_t));
  for (int64_t j = 0; j < J; ++j)
    if (idx.len[j]) std::memcpy(o + m[m[kSegs] + 4 * j + 3], idx.ptr[j], idx.len[j] * sizeof(int64_t));
  if (pos.size() % 2) o[words - 1] = -1;  // the padding half of an odd count
  if (!pos.empty()) std::memcpy(o + at_idx, pos.data(), pos.size() * sizeof(int32_t));
  return out;
}

// ---- slice_gather: segment j = sources[source_ids[j]].index_select(dims[...], indices[j]), flattened.
struct GatherPlan {
  std::vector<at::Tensor> sources;  // contiguous (a copy where the caller's was not)
  std::vector<int64_t> source;      // source[j]: the segment's source
  std::vector<SliceView> view;      // view[j]: its source as [outer, size, inner]
  std::vector<int64_t> offset;      // offset[j]: first element of segment j in the output; offset[J] = total
  HostIndices idx;

  GatherPlan(at::TensorList srcs, at::IntArrayRef source_ids, at::TensorList indices, at::IntArrayRef dims,
             const char* op)
  {
    TORCH_CHECK_VALUE(!srcs.empty(), op, ": sources is empty; give at least one tensor");
    TORCH_CHECK_VALUE(source_ids.size() == indices.size(), op,
                      ": source_ids and indices must have one entry per segment, got ", source_ids.size(), " and ",
                      indices.size());
    const auto d = check_sliced_tensors(srcs, dims, op, "sources");
    check_ids(source_ids, static_cast<int64_t>(srcs.size()), op, "source_ids", "sources");
    const int64_t J = static_cast<int64_t>(source_ids.size());
    idx = HostIndices(indices, srcs[0].device(), op);
    std::vector<uint32_t> seen;
    offset.assign(J + 1, 0);
    for (int64_t j = 0; j < J; ++j) {
      const int64_t s = source_ids[j];
      source.push_back(s);
      view.push_back(view_of(srcs[s], d[s]));
      idx.check_values(j, view[j].size, "sources[" + std::to_string(s) + "] along dim " + std::to_string(d[s]), op,
                       seen);
      offset[j + 1] = offset[j] + segment_numel(view[j], idx.len[j]);
    }
    for (const auto& t : srcs) sources.push_back(t.contiguous());
  }

  // From a plan built by slice_plan: only the per-call checks (check_plan_tensors), no index work.
  GatherPlan(const PlanView& p, at::TensorList srcs, const char* op) {
    check_plan_tensors(p, srcs, op, "sources");
    const int64_t J = p.segments();
    source.resize(J);
    view.resize(J);
    offset.resize(J + 1);
    idx.ptr.resize(J);
    idx.len.resize(J);
    for (int64_t j = 0; j < J; ++j) {
      const int64_t* r = p.seg(j);
      source[j] = r[0];
      view[j] = view_of(srcs[r[0]], p.dim(r[0]));
      idx.len[j] = r[1];
      offset[j] = r[2];
      idx.ptr[j] = p.m + r[3];
    }
    offset[J] = p.total();
    for (const auto& t : srcs) sources.push_back(t.contiguous());
  }

  int64_t segments() const { return static_cast<int64_t>(source.size()); }
  int64_t total() const { return offset.back(); }

  // A caller's output buffer (slice_gather_into_): contiguous, 1-D, the sources' dtype and device,
  // exactly total() elements, and no memory shared with a source or an index list (the kernel
  // would read what it writes).
  void check_out(const at::Tensor& out, at::TensorList srcs, at::TensorList indices, const char* op) const {
    const auto& s0 = srcs[0];
    TORCH_CHECK_TYPE(out.scalar_type() == s0.scalar_type(), op, ": out has dtype ", out.scalar_type(),
                     " but the sources have ", s0.scalar_type());
    TORCH_CHECK_VALUE(out.device() == s0.device(), op, ": out is on ", out.device(), " but the sources are on ",
                      s0.device());
    TORCH_CHECK_VALUE(out.dim() == 1 && out.numel() == total(), op, ": out must be 1-D with ", total(),
                      " elements (every segment, flattened), got shape ", shape_str(out.sizes()));
    TORCH_CHECK_VALUE(out.is_contiguous(), op, ": out must be contiguous (a flat buffer), got strides ",
                      shape_str(out.strides()));
    for (size_t t = 0; t < srcs.size(); ++t) {
      const Overlap o = memory_overlap(out, srcs[t]);
      TORCH_CHECK_VALUE(o == Overlap::kNo, op, ": out", overlap_words(o), "sources[", t,
                        "]; the gather cannot write where it reads");
    }
    for (size_t j = 0; j < indices.size(); ++j) {
      const Overlap o = memory_overlap(out, indices[j]);
      TORCH_CHECK_VALUE(o == Overlap::kNo, op, ": out", overlap_words(o), "indices[", j,
                        "]; the gather cannot write where it reads");
    }
  }
};

// ---- slice_scatter_: segment j (updates[j]) written back into targets[target_ids[j]] at indices[j].
inline SliceReduce parse_reduce(c10::string_view reduce, const char* op) {
  if (reduce == "copy") return SliceReduce::Copy;
  if (reduce == "sum") return SliceReduce::Sum;
  if (reduce == "mean") return SliceReduce::Mean;
  TORCH_CHECK_VALUE(false, op, ": reduce must be \"copy\", \"sum\" or \"mean\", got \"", std::string(reduce), "\"");
}

// Dtypes the sum / mean reductions support (copy moves any dtype).
inline bool reducible_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kLong: case at::kInt: case at::kShort: case at::kChar: case at::kByte:
      return true;
    default:
      return false;
  }
}

struct ScatterPlan {
  SliceReduce reduce;
  // Active targets: those at least one segment writes to, in ascending target order.
  std::vector<int64_t> target;        // target[a]: index into targets
  std::vector<at::Tensor> work;       // work[a]: contiguous tensor written (the target, or a temp)
  std::vector<SliceView> view;        // view[a]
  std::vector<int64_t> seg_begin;     // segments of target a: seg[seg_begin[a] .. seg_begin[a+1]), in segment order
  std::vector<int64_t> seg;           // segment ids
  std::vector<int64_t> owned_begin;   // slices of target a with >= 1 owner: owned_ptr[owned_begin[a] .. owned_begin[a+1])
  const int64_t* owned_ptr = nullptr; // ascending within a target (owned, or a plan's copy)
  // Per segment j: the compact update (contiguous) and the inverse map pos_ptr[pos_offset[j] + i].
  std::vector<at::Tensor> updates;
  std::vector<int64_t> n;             // n[j] = len(indices[j])
  std::vector<int64_t> pos_offset;
  const int32_t* pos_ptr = nullptr;   // pos, or a plan's copy
  int64_t pos_count = 0;
  std::vector<int64_t> owned;         // storage of a call without a plan
  std::vector<int32_t> pos;

  ScatterPlan(at::TensorList targets, at::IntArrayRef target_ids, at::TensorList upds, at::TensorList indices,
              at::IntArrayRef dims, c10::string_view reduce_name, const char* op) {
    TORCH_CHECK_VALUE(!targets.empty(), op, ": targets is empty; give at least one tensor");
    TORCH_CHECK_VALUE(target_ids.size() == upds.size() && upds.size() == indices.size(), op,
                      ": target_ids, updates and indices must have one entry per segment, got ", target_ids.size(),
                      ", ", upds.size(), " and ", indices.size());
    reduce = parse_reduce(reduce_name, op);
    const auto d = check_sliced_tensors(targets, dims, op, "targets");
    const auto dtype = targets[0].scalar_type();
    const auto device = targets[0].device();
    TORCH_CHECK_TYPE(reduce == SliceReduce::Copy || reducible_dtype(dtype), op, ": reduce=\"", std::string(reduce_name),
                     "\" needs a floating or integer dtype, got ", dtype, "; use reduce=\"copy\"");
    check_ids(target_ids, static_cast<int64_t>(targets.size()), op, "target_ids", "targets");
    const int64_t J = static_cast<int64_t>(target_ids.size());
    HostIndices idx(indices, device, op);
    std::vector<uint32_t> seen;
    for (int64_t j = 0; j < J; ++j) {
      const int64_t t = target_ids[j];
      const auto& u = upds[j];
      TORCH_CHECK_TYPE(u.scalar_type() == dtype, op, ": updates[", j, "] has dtype ", u.scalar_type(),
                       " but targets[", t, "] has ", dtype);
      TORCH_CHECK_VALUE(u.device() == device, op, ": updates[", j, "] is on ", u.device(), " but targets are on ",
                        device);
      auto expect = targets[t].sizes().vec();
      expect[d[t]] = idx.len[j];
      TORCH_CHECK_VALUE(u.sizes().vec() == expect, op, ": updates[", j, "] has shape ", shape_str(u.sizes()),
                        " but targets[", t, "] ", shape_str(targets[t].sizes()), " sliced along dim ", d[t],
                        " by indices[", j, "] (", idx.len[j], " slices) needs ", shape_str(expect));
      idx.check_values(j, targets[t].size(d[t]), "targets[" + std::to_string(t) + "] along dim " + std::to_string(d[t]),
                       op, seen);
    }
    // Active targets and their segments, in order.
    std::vector<std::vector<int64_t>> segs_of(targets.size());
    for (int64_t j = 0; j < J; ++j) segs_of[target_ids[j]].push_back(j);
    for (size_t t = 0; t < targets.size(); ++t)
      if (!segs_of[t].empty()) target.push_back(static_cast<int64_t>(t));
    check_no_overlap(targets, upds, indices, op);

    // Inverse maps and owned slices (nothing written to any target yet).
    n.resize(J);
    pos_offset.resize(J);
    seg_begin.push_back(0);
    owned_begin.push_back(0);
    for (const int64_t t : target) {
      const SliceView v = view_of(targets[t], d[t]);
      view.push_back(v);
      std::vector<uint8_t> any(v.size, 0);
      for (const int64_t j : segs_of[t]) {
        seg.push_back(j);
        n[j] = idx.len[j];
        pos_offset[j] = static_cast<int64_t>(pos.size());
        pos.resize(pos.size() + v.size, -1);
        fill_inverse_map(idx.ptr[j], n[j], pos.data() + pos_offset[j]);
        for (int64_t k = 0; k < n[j]; ++k) any[idx.ptr[j][k]] = 1;
      }
      for (int64_t i = 0; i < v.size; ++i)
        if (any[i]) owned.push_back(i);
      seg_begin.push_back(static_cast<int64_t>(seg.size()));
      owned_begin.push_back(static_cast<int64_t>(owned.size()));
    }
    for (int64_t j = 0; j < J; ++j) updates.push_back(upds[j].contiguous());
    for (const int64_t t : target) work.push_back(targets[t].is_contiguous() ? targets[t] : targets[t].contiguous());
    owned_ptr = owned.data();
    pos_ptr = pos.data();
    pos_count = static_cast<int64_t>(pos.size());
  }

  // From a plan built by slice_plan: the per-call checks (the targets and updates are those the
  // plan describes; no aliasing) and no index work.
  ScatterPlan(const PlanView& p, at::TensorList targets, at::TensorList upds, c10::string_view reduce_name,
              const char* op) {
    reduce = parse_reduce(reduce_name, op);
    check_plan_tensors(p, targets, op, "targets");
    const auto dtype = p.dtype();
    TORCH_CHECK_TYPE(reduce == SliceReduce::Copy || reducible_dtype(dtype), op, ": reduce=\"", std::string(reduce_name),
                     "\" needs a floating or integer dtype, got ", dtype, "; use reduce=\"copy\"");
    const int64_t J = p.segments();
    TORCH_CHECK_VALUE(static_cast<int64_t>(upds.size()) == J, op, ": the plan has ", J,
                      " segments but got ", upds.size(), " updates");
    n.resize(J);
    for (int64_t j = 0; j < J; ++j) {
      const int64_t* r = p.seg(j);
      const int64_t t = r[0];
      const auto& u = upds[j];
      n[j] = r[1];
      TORCH_CHECK_TYPE(u.scalar_type() == dtype, op, ": updates[", j, "] has dtype ", u.scalar_type(),
                       " but targets[", t, "] has ", dtype);
      TORCH_CHECK_VALUE(u.device() == p.device(), op, ": updates[", j, "] is on ", u.device(),
                        " but targets are on ", p.device());
      const auto ts = targets[t].sizes();
      const auto us = u.sizes();
      bool same = us.size() == ts.size();
      for (size_t k = 0; same && k < ts.size(); ++k)
        same = us[k] == (static_cast<int64_t>(k) == p.dim(t) ? n[j] : ts[k]);
      if (!same) {  // the message builds the expected shape; the check itself allocates nothing
        auto expect = ts.vec();
        expect[p.dim(t)] = n[j];
        TORCH_CHECK_VALUE(false, op, ": updates[", j, "] has shape ", shape_str(us), " but targets[", t, "] ",
                          shape_str(ts), " sliced along dim ", p.dim(t), " by the plan's segment ", j, " (", n[j],
                          " slices) needs ", shape_str(expect));
      }
    }
    const int64_t A = p.active();
    for (int64_t a = 0; a <= A; ++a) {
      const int64_t* r = p.target(a);
      if (a < A) {
        target.push_back(r[0]);
        view.push_back(view_of(targets[r[0]], p.dim(r[0])));
      }
      seg_begin.push_back(r[1]);
      owned_begin.push_back(r[2]);
    }
    seg.assign(p.seg_order(), p.seg_order() + J);
    pos_offset.assign(p.pos_offset(), p.pos_offset() + J);
    owned_ptr = p.owned();
    pos_ptr = p.pos();
    pos_count = p.pos_count();
    check_no_overlap(targets, upds, {}, op);
    for (int64_t j = 0; j < J; ++j) updates.push_back(upds[j].contiguous());
    for (const int64_t t : target) work.push_back(targets[t].is_contiguous() ? targets[t] : targets[t].contiguous());
  }

  int64_t active() const { return static_cast<int64_t>(target.size()); }

  // Write the results of non-contiguous targets back (after the kernel ran into `work`).
  void copy_back(at::TensorList targets) const {
    for (int64_t a = 0; a < active(); ++a)
      if (!work[a].is_same(targets[target[a]])) targets[target[a]].copy_(work[a]);
  }

 private:
  // A written target must not share memory with another target, an update or an index list (the
  // kernel would read what it writes; with mixed dtypes a later launch would read a list an
  // earlier one wrote). Spans are sorted by start, so the usual case (nothing overlaps) costs
  // O(T log T); spans that meet are compared precisely (memory_overlap).
  void check_no_overlap(at::TensorList targets, at::TensorList upds, at::TensorList indices, const char* op) const {
    enum Kind { kTarget, kUpdate, kIndices };
    struct Span {
      uintptr_t begin, end;
      Kind kind;
      int64_t index;
    };
    static const char* const kNames[] = {"targets[", "updates[", "indices["};
    auto tensor_of = [&](const Span& s) -> const at::Tensor& {
      return s.kind == kTarget ? targets[s.index] : s.kind == kUpdate ? upds[s.index] : indices[s.index];
    };
    std::vector<Span> spans;
    auto add = [&](const at::Tensor& t, Kind kind, int64_t index) {
      if (t.numel() == 0) return;
      int64_t lo = 0, hi = 0;
      for (int64_t d = 0; d < t.dim(); ++d) {
        const int64_t ext = (t.size(d) - 1) * t.stride(d);
        (ext < 0 ? lo : hi) += ext;
      }
      const auto b = reinterpret_cast<uintptr_t>(t.const_data_ptr());
      const auto es = static_cast<uintptr_t>(t.element_size());
      spans.push_back(Span{b + static_cast<uintptr_t>(lo) * es, b + static_cast<uintptr_t>(hi + 1) * es, kind, index});
    };
    for (const int64_t t : target) {
      TORCH_CHECK_VALUE(targets[t].numel() == 0 || at::has_internal_overlap(targets[t]) != at::MemOverlap::Yes, op,
                        ": targets[", t, "] has elements that share memory (an expanded view?); it cannot be written "
                        "in place");
      add(targets[t], kTarget, t);
    }
    for (size_t j = 0; j < upds.size(); ++j) add(upds[j], kUpdate, static_cast<int64_t>(j));
    for (size_t j = 0; j < indices.size(); ++j) add(indices[j], kIndices, static_cast<int64_t>(j));
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    for (size_t a = 0; a < spans.size(); ++a) {
      for (size_t b = a + 1; b < spans.size() && spans[b].begin < spans[a].end; ++b) {
        const Span &x = spans[a], &y = spans[b];
        if (x.kind != kTarget && y.kind != kTarget) continue;
        const Overlap o = memory_overlap(tensor_of(x), tensor_of(y));
        if (o == Overlap::kNo) continue;
        const Span& t = x.kind == kTarget ? x : y;
        const Span& other = x.kind == kTarget ? y : x;
        TORCH_CHECK_VALUE(false, op, ": targets[", t.index, "]", overlap_words(o), kNames[other.kind], other.index,
                          "]; targets are written in place and must not alias another target, an update or an "
                          "index list");
      }
    }
  }
};

}  // namespace ist
