// torch bindings of the CUDA slice kernels (csrc/cuda/slices.cu). Checks and the host plan come from
// csrc/slices_plan.h (shared with the CPU kernels); here the plan is written into one pinned host
// buffer (records, then index lists or inverse maps), copied to the device in one asynchronous
// transfer on the current stream, and one kernel runs for all tensors.
//
// Index lists: give them on the CPU (int64 CPU tensors with CUDA data tensors). Then a call never
// waits for the device: the lists are validated (range, duplicates) and the plan is built on the
// host while earlier work still runs, and the only transfer is the stream-ordered upload from
// pinned memory. Lists on the CUDA device are accepted too but cost one device->host copy, i.e. a
// synchronisation with the stream, per call (the Exchange and the partition code keep their lists
// on the host).
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/all.h>
#include <torch/library.h>

#include <cstring>

#include "cuda/slices.cuh"
#include "slices_plan.h"

namespace ist::cuda {
namespace {

// A byte buffer laid out on the host, then copied to the device; addresses of its parts are known
// before the copy, so records can point into the device copy.
struct PlanBuffer {
  at::Tensor host, device;

  PlanBuffer(int64_t bytes, const at::Device& dev) {
    host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    device = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(dev));
  }
  template <typename T>
  T* host_at(int64_t offset) { return reinterpret_cast<T*>(host.data_ptr<uint8_t>() + offset); }
  template <typename T>
  T* device_at(int64_t offset) { return reinterpret_cast<T*>(device.data_ptr<uint8_t>() + offset); }
  void upload() { device.copy_(host, /*non_blocking=*/true); }  // stream-ordered; the pinned block is kept until done
};

int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Largest power of two <= max_bytes dividing `bytes` and aligning every address in `ptrs`.
int64_t common_unit(int64_t bytes, const std::vector<uintptr_t>& ptrs, int64_t max_bytes = 16) {
  int64_t unit = max_bytes;
  while (unit > 1) {
    bool ok = bytes % unit == 0;
    for (const auto p : ptrs) ok = ok && p % static_cast<uintptr_t>(unit) == 0;
    if (ok) break;
    unit /= 2;
  }
  return unit;
}

constexpr int64_t kMaxBlocks = (int64_t{1} << 31) - 1;

// Where the records of a launch are written: `host` (laid out here), with device addresses
// computed from `device` (the buffer they will be copied to), so records can point into it.
struct Sink {
  uint8_t* host;
  uint8_t* device;
  template <typename T>
  T* host_at(int64_t offset) const { return reinterpret_cast<T*>(host + offset); }
  template <typename T>
  T* device_at(int64_t offset) const { return reinterpret_cast<T*>(device + offset); }
};

// A launch's records: their size first (layout), then written into a Sink (encode).
struct GatherLaunch {
  std::vector<int64_t> live;  // segments that move at least one element
  int64_t records = 0, bytes = 0, blocks = 0;

  explicit GatherLaunch(const GatherPlan& plan) {
    int64_t num_idx = 0;
    for (int64_t j = 0; j < plan.segments(); ++j)
      if (plan.offset[j + 1] > plan.offset[j]) {
        live.push_back(j);
        num_idx += plan.idx.len[j];
      }
    records = align16(static_cast<int64_t>(live.size() * sizeof(GatherSegment)));
    bytes = records + num_idx * static_cast<int64_t>(sizeof(int64_t));
  }
  int64_t segments() const { return static_cast<int64_t>(live.size()); }

  int64_t record_bytes() const { return records; }

  // statics: also write the index lists (the records only, when comparing with a cached upload).
  void encode(const GatherPlan& plan, const at::Tensor& out, const Sink& buf, bool statics = true) {
    const int64_t esize = plan.sources[0].element_size();
    const int64_t L = segments();
    auto* seg = buf.host_at<GatherSegment>(0);
    std::memset(buf.host, 0, static_cast<size_t>(records));  // padding too: records are compared bytewise
    int64_t idx_at = records;
    blocks = 0;
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t l = 0; l < L; ++l) {
      const int64_t j = live[l];
      const SliceView& v = plan.view[j];
      GatherSegment& s = seg[l];
      s.src = static_cast<const char*>(plan.sources[plan.source[j]].const_data_ptr());
      s.dst = dst + plan.offset[j] * esize;
      const auto dst_addr = reinterpret_cast<uintptr_t>(s.dst);
      s.unit = static_cast<int32_t>(common_unit(v.inner * esize, {reinterpret_cast<uintptr_t>(s.src), dst_addr}));
      const int64_t bytes = (plan.offset[j + 1] - plan.offset[j]) * esize;
      s.store = s.unit < 16 && bytes % 16 == 0 && dst_addr % 16 == 0 ? 16 : s.unit;
      s.row_units = v.inner * esize / s.unit;
      s.n = plan.idx.len[j];
      s.size = v.size;
      s.units = v.outer * s.n * s.row_units;
      s.items = bytes / s.store;
      s.wide = s.units > kFastDivMax ? 1 : 0;
      s.row_div = make_fast_div(static_cast<uint32_t>(s.wide ? 1 : s.row_units));
      s.n_div = make_fast_div(static_cast<uint32_t>(s.wide ? 1 : s.n));
      s.block_start = blocks;
      const int64_t per_block = kSliceThreads * gather_items_per_thread(s.store / s.unit);
      blocks += (s.items + per_block - 1) / per_block;
      if (statics) std::memcpy(buf.host_at<int64_t>(idx_at), plan.idx.ptr[j], s.n * sizeof(int64_t));
      s.idx = buf.device_at<const int64_t>(idx_at);
      idx_at += s.n * static_cast<int64_t>(sizeof(int64_t));
    }
    TORCH_CHECK_VALUE(blocks <= kMaxBlocks, "slice_gather: ", plan.total(), " elements need ", blocks,
                      " blocks, more than one launch allows");
  }

  void launch(const uint8_t* device) const {
    C10_CUDA_CHECK(ist::cuda::slice_gather(reinterpret_cast<const GatherSegment*>(device), segments(), blocks,
                                           c10::cuda::getCurrentCUDAStream()));
  }
};

// The gather kernel: every segment of a checked plan into out (contiguous, plan.total() elements),
// one launch on the current stream.
void gather_into(const GatherPlan& plan, const at::Tensor& out) {
  if (plan.total() == 0) return;
  GatherLaunch g(plan);
  PlanBuffer buf(g.bytes, plan.sources[0].device());
  g.encode(plan, out, Sink{buf.host.data_ptr<uint8_t>(), buf.device.data_ptr<uint8_t>()});
  buf.upload();
  g.launch(buf.device.data_ptr<uint8_t>());
}

at::Tensor slice_gather_cuda(at::TensorList sources, at::IntArrayRef source_ids, at::TensorList indices,
                             at::IntArrayRef dims) {
  c10::cuda::OptionalCUDAGuard guard;
  if (!sources.empty() && sources[0].is_cuda()) guard.set_device(sources[0].device());
  const GatherPlan plan(sources, source_ids, indices, dims, "slice_gather");
  auto out = at::empty({plan.total()}, plan.sources[0].options());
  gather_into(plan, out);
  return out;
}

void slice_gather_into_cuda(at::Tensor& out, at::TensorList sources, at::IntArrayRef source_ids,
                            at::TensorList indices, at::IntArrayRef dims) {
  c10::cuda::OptionalCUDAGuard guard;
  if (out.is_cuda()) guard.set_device(out.device());
  const GatherPlan plan(sources, source_ids, indices, dims, "slice_gather_into_");
  plan.check_out(out, sources, indices, "slice_gather_into_");
  gather_into(plan, out);
}

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::Float32;
    case at::kDouble: return ScalarKind::Float64;
    case at::kHalf: return ScalarKind::Float16;
    case at::kBFloat16: return ScalarKind::BFloat16;
    case at::kLong: return ScalarKind::Int64;
    case at::kInt: return ScalarKind::Int32;
    case at::kShort: return ScalarKind::Int16;
    case at::kChar: return ScalarKind::Int8;
    case at::kByte: return ScalarKind::UInt8;
    default: return ScalarKind::Float32;  // copy only: checked by the plan
  }
}

struct ScatterLaunch {
  int64_t t_bytes = 0, s_bytes = 0, bytes = 0, blocks = 0;

  explicit ScatterLaunch(const ScatterPlan& plan) {
    t_bytes = align16(plan.active() * static_cast<int64_t>(sizeof(ScatterTarget)));
    s_bytes = align16(static_cast<int64_t>(plan.seg.size() * sizeof(ScatterSegment)));
    bytes = t_bytes + s_bytes + plan.pos_count * static_cast<int64_t>(sizeof(int32_t));
  }

  int64_t record_bytes() const { return t_bytes + s_bytes; }

  // statics: also write the inverse maps (the records only, when comparing with a cached upload).
  void encode(const ScatterPlan& plan, const Sink& buf, bool statics = true) {
    const int64_t A = plan.active();
    const int64_t esize = plan.work[0].element_size();
    std::memset(buf.host, 0, static_cast<size_t>(t_bytes + s_bytes));  // padding too: compared bytewise
    auto* tgt = buf.host_at<ScatterTarget>(0);
    auto* seg = buf.host_at<ScatterSegment>(t_bytes);
    if (statics && plan.pos_count)
      std::memcpy(buf.host_at<int32_t>(t_bytes + s_bytes), plan.pos_ptr, plan.pos_count * sizeof(int32_t));
    const int32_t* pos = buf.device_at<const int32_t>(t_bytes + s_bytes);
    blocks = 0;
    for (int64_t a = 0; a < A; ++a) {
      const SliceView& v = plan.view[a];
      ScatterTarget& t = tgt[a];
      t.data = static_cast<char*>(plan.work[a].data_ptr());
      // Loads as wide as the row length and every address allow (up to scatter_max_unit), stored
      // as such, or element loads stored as scatter_max_unit vectors where the target allows.
      std::vector<uintptr_t> addrs{reinterpret_cast<uintptr_t>(t.data)};
      for (int64_t s = plan.seg_begin[a]; s < plan.seg_begin[a + 1]; ++s) {
        const int64_t j = plan.seg[s];
        seg[s].update = static_cast<const char*>(plan.updates[j].const_data_ptr());
        seg[s].pos = pos + plan.pos_offset[j];
        seg[s].n = plan.n[j];
        if (seg[s].n > 0) addrs.push_back(reinterpret_cast<uintptr_t>(seg[s].update));
      }
      const int64_t max_unit = scatter_max_unit(static_cast<int>(esize));
      const int64_t bytes = v.outer * v.size * v.inner * esize;
      t.unit = static_cast<int32_t>(common_unit(v.inner * esize, addrs, max_unit));
      t.store = t.unit == esize && esize < max_unit && bytes % max_unit == 0 && addrs[0] % max_unit == 0 ? max_unit : t.unit;
      t.units = bytes / t.unit;
      t.items = bytes / t.store;
      t.size = v.size;
      t.row_units = v.inner * esize / t.unit;
      t.seg_begin = plan.seg_begin[a];
      t.seg_end = plan.seg_begin[a + 1];
      t.wide = t.units > kFastDivMax ? 1 : 0;
      t.row_div = make_fast_div(static_cast<uint32_t>(t.wide || t.units == 0 ? 1 : t.row_units));
      t.size_div = make_fast_div(static_cast<uint32_t>(t.wide || t.units == 0 ? 1 : t.size));
      t.block_start = blocks;
      // Targets whose slices no segment owns need no blocks.
      const bool owned = plan.owned_begin[a + 1] > plan.owned_begin[a];
      const int64_t per_block = kSliceThreads * scatter_items_per_thread(t.store / t.unit);
      if (owned) blocks += (t.items + per_block - 1) / per_block;
    }
    TORCH_CHECK_VALUE(blocks <= kMaxBlocks, "slice_scatter_: the targets need ", blocks,
                      " blocks, more than one launch allows");
  }

  void launch(const ScatterPlan& plan, const uint8_t* device) const {
    const auto& w = plan.work[0];
    C10_CUDA_CHECK(ist::cuda::slice_scatter(reinterpret_cast<const ScatterTarget*>(device), plan.active(),
                                            reinterpret_cast<const ScatterSegment*>(device + t_bytes), blocks,
                                            plan.reduce, scalar_kind(w.scalar_type()), w.element_size(),
                                            c10::cuda::getCurrentCUDAStream()));
  }
};

void slice_scatter_cuda(at::TensorList targets, at::IntArrayRef target_ids, at::TensorList updates,
                        at::TensorList indices, at::IntArrayRef dims, c10::string_view reduce) {
  c10::cuda::OptionalCUDAGuard guard;
  if (!targets.empty() && targets[0].is_cuda()) guard.set_device(targets[0].device());
  const ScatterPlan plan(targets, target_ids, updates, indices, dims, reduce, "slice_scatter_");
  if (plan.active() == 0) return;
  ScatterLaunch s(plan);
  PlanBuffer buf(s.bytes, targets[0].device());
  s.encode(plan, Sink{buf.host.data_ptr<uint8_t>(), buf.device.data_ptr<uint8_t>()});
  buf.upload();
  s.launch(plan, buf.device.data_ptr<uint8_t>());
  plan.copy_back(targets);
}

// ---- From a plan built once (slice_plan). cache = [host bytes (CPU), device bytes (this device)],
// the plan's records as last uploaded (then its index lists / inverse maps, which never change).
// Each call encodes its records on the host (O(segments), no index work) and compares them with
// the host copy: unchanged (the same tensors as before), it only launches, which a CUDA graph can capture and which never waits for the device; changed (a
// tensor moved), it uploads them from a fresh pinned block, stream-ordered, which cannot be
// captured (run a call once before capturing).
constexpr int64_t kCacheHeader = 16;

template <typename Launch, typename Encode, typename Run>
void run_cached(Launch& l, at::TensorList cache, const at::Device& device, const char* op, Encode encode, Run run) {
  TORCH_CHECK_VALUE(cache.size() == 2 && cache[0].device().is_cpu() && cache[1].device() == device &&
                        cache[0].scalar_type() == at::kByte && cache[1].scalar_type() == at::kByte &&
                        cache[0].is_contiguous() && cache[1].is_contiguous() && cache[0].numel() == cache[1].numel(),
                    op, ": cache must be [host bytes, device bytes]: two uint8 tensors of one size, on the CPU and on ",
                    device);
  TORCH_CHECK_VALUE(cache[0].numel() >= l.bytes + kCacheHeader, op, ": cache holds ", cache[0].numel(), " bytes but the plan's ",
                    "records need ", l.bytes + kCacheHeader);
  // The first 8 bytes of the host copy hold the size last uploaded (0: never); records start at kCacheHeader.
  uint8_t* host = cache[0].data_ptr<uint8_t>();
  uint8_t* device_bytes = cache[1].data_ptr<uint8_t>() + kCacheHeader;
  const int64_t records = l.record_bytes();
  std::vector<uint8_t> fresh(static_cast<size_t>(records));
  encode(Sink{fresh.data(), device_bytes}, /*statics=*/false);
  int64_t last = 0;
  std::memcpy(&last, host, sizeof(last));
  if (last != l.bytes || std::memcmp(host + kCacheHeader, fresh.data(), fresh.size()) != 0) {
    TORCH_CHECK_VALUE(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, op,
                      ": the plan's device records must be uploaded again (first call, or a tensor's address "
                      "changed since the last call), which a CUDA graph cannot capture; call it once before capturing");
    const int64_t nbytes = l.bytes;
    at::Tensor pinned = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    encode(Sink{pinned.data_ptr<uint8_t>(), device_bytes}, /*statics=*/true);
    cache[1].narrow(0, kCacheHeader, nbytes).copy_(pinned, /*non_blocking=*/true);
    std::memcpy(host + kCacheHeader, fresh.data(), fresh.size());
    std::memcpy(host, &nbytes, sizeof(nbytes));
  }
  run(device_bytes);
}

void slice_plan_gather_cuda(at::Tensor& out, at::TensorList sources, const at::Tensor& plan, at::TensorList cache) {
  const char* op = "slice_plan_gather_";
  c10::cuda::OptionalCUDAGuard guard;
  if (out.is_cuda()) guard.set_device(out.device());
  const PlanView p(plan, op);
  const GatherPlan g(p, sources, op);
  g.check_out(out, sources, {}, op);
  if (g.total() == 0) return;
  GatherLaunch l(g);
  run_cached(l, cache, out.device(), op, [&](const Sink& sink, bool statics) { l.encode(g, out, sink, statics); },
             [&](const uint8_t* device) { l.launch(device); });
}

void slice_plan_scatter_cuda(at::TensorList targets, at::TensorList updates, const at::Tensor& plan,
                             c10::string_view reduce, at::TensorList cache) {
  const char* op = "slice_plan_scatter_";
  c10::cuda::OptionalCUDAGuard guard;
  if (!targets.empty() && targets[0].is_cuda()) guard.set_device(targets[0].device());
  const PlanView p(plan, op);
  const ScatterPlan sp(p, targets, updates, reduce, op);
  if (sp.active() == 0) return;
  ScatterLaunch l(sp);
  run_cached(l, cache, targets[0].device(), op, [&](const Sink& sink, bool statics) { l.encode(sp, sink, statics); },
             [&](const uint8_t* device) { l.launch(sp, device); });
  sp.copy_back(targets);
}

}  // namespace

TORCH_LIBRARY_IMPL(ist_kernels, CUDA, m) {
  m.impl("slice_gather", &slice_gather_cuda);
  m.impl("slice_gather_into_", &slice_gather_into_cuda);
  m.impl("slice_scatter_", &slice_scatter_cuda);
  m.impl("slice_plan_gather_", &slice_plan_gather_cuda);
  m.impl("slice_plan_scatter_", &slice_plan_scatter_cuda);
}

}  // namespace ist::cuda
