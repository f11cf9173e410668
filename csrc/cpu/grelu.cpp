// CPU kernels for the GReLU layers (paper 004 §2.1, §4.4): relu_gates, gated_linear,
// gated_linear_backward.
//
// The GEMMs go to at::mm / at::addmm (oneDNN/BLAS, already parallel and blocked); what is ours is
// the epilogue, one parallel pass over the [M, N] result that reads or writes the 1-bit gates
// directly (relu + bit-pack; mask multiply) and, in the backward, the masked gradient
// g' = g * G built in one pass before the two GEMMs. No float or bool mask is ever materialised.
// "* G" is a multiply by 0 or 1 (the math of y = z ⊙ G), so a NaN/inf at an off gate still
// propagates, as it does in the torch composition.
#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "checks.h"
#include "common/gates.h"

namespace ist::cpu {
namespace {

// Rows per parallel chunk: about 32K elements of epilogue work per chunk.
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(n, 1)); }

// x [..., K] -> [M, K] (a view when possible; x itself when 2-D: no new tensor on the common path).
// M is the product of the leading dims, also when K == 0.
at::Tensor rows_of(const at::Tensor& t) {
  if (t.dim() == 2) return t;
  const int64_t K = t.size(-1);
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) M *= t.size(d);
  return t.reshape({M, K});
}

// z = x W^T + b as a fresh contiguous [M, N] tensor.
at::Tensor linear_rows(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) return at::addmm(*bias, x2, weight.t());
  return at::mm(x2, weight.t());
}

// z [M, last] as t's leading dims + [last] (z itself when t is 2-D).
at::Tensor as_leading(const at::Tensor& z, const at::Tensor& t, int64_t last) {
  if (t.dim() == 2) return z;
  auto s = t.sizes().vec();
  s.back() = last;
  return z.view(s);
}

std::vector<int64_t> with_last(const at::Tensor& t, int64_t last) {
  auto s = t.sizes().vec();
  s.back() = last;
  return s;
}

// The per-word loops below are branch-free (the gates are random bits: a branch on them would
// mispredict half the time) and written so the compiler vectorizes them with the baseline ISA:
// no per-lane variable shifts; bits are expanded through a byte table and gathered from bytes
// with one multiply per 8 features.

// kByteBits.v[b][i] = bit i of byte b, as 0.f / 1.f (8 KiB, stays in L1).
struct ByteBits {
  float v[256][8];
  constexpr ByteBits() : v{} {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) v[b][i] = static_cast<float>((b >> i) & 1);
  }
};
constexpr ByteBits kByteBits{};

// 8 bytes of 0/1 (byte i -> bit i) into one byte: the multiply moves byte i's bit to bit 56 + i.
inline uint32_t gather_bits8(const uint8_t* on) {
  if constexpr (std::endian::native == std::endian::little) {
    uint64_t x;
    std::memcpy(&x, on, 8);
    return static_cast<uint32_t>((x * 0x0102040810204080ull) >> 56);
  } else {
    uint32_t b = 0;
    for (int i = 0; i < 8; ++i) b |= static_cast<uint32_t>(on[i]) << i;
    return b;
  }
}

// Compute lanes: T is read as float (double for double) and written back from a value that is
// exactly representable in T (v, 0 or v * 0/1), so bf16 needs only shifts, which vectorize.
template <typename T>
struct Lanes {
  using F = float;
  static F load(T v) { return static_cast<F>(v); }
  static T store_exact(F f) { return static_cast<T>(f); }
};
template <>
struct Lanes<double> {
  using F = double;
  static F load(double v) { return v; }
  static double store_exact(F f) { return f; }
};
template <>
struct Lanes<c10::BFloat16> {
  using F = float;
  static F load(c10::BFloat16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16); }
  static c10::BFloat16 store_exact(F f) {  // f is a bf16 value: truncation is exact
    return c10::BFloat16(static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16), c10::BFloat16::from_bits());
  }
};

// In place over one word of n <= 32 features: v <- relu(v) (NaN propagates, as torch.relu);
// returns the word of bits v > 0.
template <typename T>
inline uint32_t relu_pack_word(T* __restrict__ v, int n = kGateBits) {
  using L = Lanes<T>;
  using F = typename L::F;
  uint8_t on[kGateBits] = {};
  const auto step = [&](int j) {
    const F f = L::load(v[j]);
    on[j] = f > F(0);
    v[j] = L::store_exact(f <= F(0) ? F(0) : f);
  };
  if (n == kGateBits) {
    for (int j = 0; j < kGateBits; ++j) step(j);
  } else {
    for (int j = 0; j < n; ++j) step(j);
  }
  return gather_bits8(on) | gather_bits8(on + 8) << 8 | gather_bits8(on + 16) << 16 | gather_bits8(on + 24) << 24;
}

// out[j] = in[j * stride] * (bit j of word), n <= 32 features; in == out is allowed. A multiply by
// 0/1, so a NaN/inf at an off gate propagates as in the torch composition.
template <typename T, bool kUnit>
inline void mask_word(const T* in, int64_t stride, uint32_t word, T* out, int n = kGateBits) {
  using L = Lanes<T>;
  using F = typename L::F;
  F bits[kGateBits];
  for (int q = 0; q < 4; ++q)
    for (int i = 0; i < 8; ++i) bits[8 * q + i] = static_cast<F>(kByteBits.v[(word >> (8 * q)) & 255u][i]);
  T vals[kGateBits];  // read all, then write: in-place is safe and both loops vectorize
  if (n == kGateBits) {
    for (int j = 0; j < kGateBits; ++j) vals[j] = in[kUnit ? j : j * stride];
    for (int j = 0; j < kGateBits; ++j) out[j] = L::store_exact(L::load(vals[j]) * bits[j]);
  } else {
    for (int j = 0; j < n; ++j) vals[j] = in[kUnit ? j : j * stride];
    for (int j = 0; j < n; ++j) out[j] = L::store_exact(L::load(vals[j]) * bits[j]);
  }
}

// In place: z <- relu(z), gates <- pack(z > 0).
template <typename T>
void relu_pack_rows(T* z, int32_t* gates, int64_t M, int64_t N) {
  const int64_t W = gate_words(N);
  const int64_t full = N / kGateBits;
  const int tail = static_cast<int>(N - full * kGateBits);
  at::parallel_for(0, M, row_grain(N), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* row = z + r * N;
      int32_t* words = gates + r * W;
      for (int64_t w = 0; w < full; ++w) words[w] = static_cast<int32_t>(relu_pack_word<T>(row + w * kGateBits));
      if (tail) words[full] = static_cast<int32_t>(relu_pack_word<T>(row + full * kGateBits, tail));
    }
  });
}

// dst[m, f] = src[m, f] * G[m, f] for a [M, N] src with strides (s0, s1); dst contiguous, may equal src.
template <typename T, bool kUnit>
void mask_rows_impl(const T* src, int64_t s0, int64_t s1, const int32_t* gates, T* dst, int64_t M, int64_t N) {
  const int64_t W = gate_words(N);
  const int64_t full = N / kGateBits;
  const int tail = static_cast<int>(N - full * kGateBits);
  at::parallel_for(0, M, row_grain(N), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* in = src + r * s0;
      T* out = dst + r * N;
      const int32_t* words = gates + r * W;
      for (int64_t w = 0; w < full; ++w)
        mask_word<T, kUnit>(in + w * kGateBits * s1, s1, static_cast<uint32_t>(words[w]), out + w * kGateBits);
      if (tail)
        mask_word<T, kUnit>(in + full * kGateBits * s1, s1, static_cast<uint32_t>(words[full]),
                               out + full * kGateBits, tail);
    }
  });
}

template <typename T>
void mask_rows(const T* src, int64_t s0, int64_t s1, const int32_t* gates, T* dst, int64_t M, int64_t N) {
  if (s1 == 1) return mask_rows_impl<T, true>(src, s0, 1, gates, dst, M, N);
  mask_rows_impl<T, false>(src, s0, s1, gates, dst, M, N);
}

#define IST_GRELU_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

}  // namespace

std::tuple<at::Tensor, at::Tensor> relu_gates(const at::Tensor& x, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& bias) {
  const NoAutocast no_autocast;
  check_grelu_linear("relu_gates", x, weight, bias);
  const int64_t N = weight.size(0);
  auto z = linear_rows(rows_of(x), weight, bias);  // [M, N], contiguous
  const int64_t M = z.size(0);
  auto gates = at::empty({M, gate_words(N)}, x.options().dtype(at::kInt));
  IST_GRELU_DISPATCH(z.scalar_type(), "relu_gates",
                     [&] { relu_pack_rows(z.data_ptr<scalar_t>(), gates.data_ptr<int32_t>(), M, N); });
  return {as_leading(z, x, N), as_leading(gates, x, gate_words(N))};
}

at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        const at::Tensor& gates) {
  const NoAutocast no_autocast;
  check_grelu_linear("gated_linear", x, weight, bias);
  const int64_t N = weight.size(0);
  check_grelu_gates("gated_linear", gates, x, N);
  auto z = linear_rows(rows_of(x), weight, bias);
  const int64_t M = z.size(0);
  const auto g = rows_of(gates).contiguous();
  IST_GRELU_DISPATCH(z.scalar_type(), "gated_linear", [&] {
    scalar_t* p = z.data_ptr<scalar_t>();
    mask_rows<scalar_t>(p, N, 1, g.const_data_ptr<int32_t>(), p, M, N);
  });
  return as_leading(z, x, N);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_linear_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                                     const at::Tensor& weight, const at::Tensor& gates,
                                                                     const c10::List<bool>& mask) {
  const NoAutocast no_autocast;
  const char* op = "gated_linear_backward";
  check_grelu_linear(op, x, weight, std::nullopt);
  const std::array<bool, 3> output_mask = check_output_mask(mask, op);
  const int64_t N = weight.size(0);
  TORCH_CHECK_VALUE(grad_out.device() == x.device(), op, ": grad_out is on ", grad_out.device(), " but x is on ",
                    x.device(), "; all tensors must be on one device");
  TORCH_CHECK_TYPE(grad_out.scalar_type() == x.scalar_type(), op, ": grad_out must have x's dtype ", x.scalar_type(),
                   ", got ", grad_out.scalar_type());
  TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(with_last(x, N)), op, ": grad_out must be ",
                    at::IntArrayRef(with_last(x, N)), " (x's leading dims, out_features), got ", grad_out.sizes());
  check_grelu_gates(op, gates, x, N);

  // Outputs not asked for are distinct empty tensors (outputs must not alias each other).
  auto empty = [&] { return x.new_empty({0}); };
  if (!output_mask[0] && !output_mask[1] && !output_mask[2]) return {empty(), empty(), empty()};
  const auto x2 = rows_of(x);
  const int64_t M = x2.size(0);
  const auto g2 = rows_of(grad_out);  // a view when possible; read through its strides
  const auto G = rows_of(gates).contiguous();
  auto gm = at::empty({M, N}, grad_out.options());  // g' = g * G, the only extra [M, N] pass
  IST_GRELU_DISPATCH(gm.scalar_type(), "gated_linear_backward", [&] {
    mask_rows<scalar_t>(g2.const_data_ptr<scalar_t>(), g2.stride(0), g2.stride(1), G.const_data_ptr<int32_t>(),
                        gm.data_ptr<scalar_t>(), M, N);
  });
  at::Tensor grad_x = output_mask[0] ? at::mm(gm, weight).view(x.sizes()) : empty();
  at::Tensor grad_weight = output_mask[1] ? at::mm(gm.t(), x2) : empty();
  at::Tensor grad_bias = output_mask[2] ? gm.sum(0) : empty();
  return {grad_x, grad_weight, grad_bias};
}

TORCH_LIBRARY_IMPL(ist_kernels, CPU, m) {
  m.impl("relu_gates", &relu_gates);
  m.impl("gated_linear", &gated_linear);
  m.impl("gated_linear_backward", &gated_linear_backward);
}

}  // namespace ist::cpu
