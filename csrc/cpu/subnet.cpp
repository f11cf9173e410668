// CPU kernels for subnet_linear / subnet_linear_backward (IST, paper 001 §3.1): the linear layer of
// one subnetwork, y = x W[rows][:, cols]^T + b[rows], with gradients landing in the full-size
// parameters at the selected rows x cols only.
//
// W[rows][:, cols] is never materialised as a whole: output features are processed in blocks, in
// parallel; each block's slice of the subnetwork weight is gathered into a small per-thread tile
// (sized to stay in cache) and multiplied with at::mm straight into that block's slice of the
// output. The backward does the same by blocks of input features (grad_x) and of output features
// (grad_weight, scattered back to rows x cols).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/all.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "common/indices.h"

namespace ist::cpu {
namespace {

// The subnetwork one call works on, after every argument check.
struct Subnet {
  int64_t N = 0, K = 0;                        // full weight [N, K]
  int64_t Nr = 0, Kc = 0;                      // selected output rows, input columns
  // rows / cols: the index lists, or nullptr for all rows / columns (index_at). An empty list may
  // also have a null data pointer, so "all" is told by all_rows / all_cols, never by the pointer.
  const int64_t* rows = nullptr;
  const int64_t* cols = nullptr;
  bool all_rows = true, all_cols = true;
  at::Tensor rows_c, cols_c;                   // contiguous index lists that rows/cols point into
  std::vector<uint32_t> row_selected;          // bitmap over the N rows
};

void check_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kDouble || d == at::kBFloat16 || d == at::kHalf, op, ": ", name,
                   " must be float32, float64, bfloat16 or float16 on the CPU, got ", d);
}

Subnet check_subnet(const char* op, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& rows,
                    const std::optional<at::Tensor>& cols) {
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got ", weight.dim(),
                    " dimensions");
  check_dtype(weight, op, "weight");
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension (features last), got a 0-d tensor");
  TORCH_CHECK_VALUE(x.device() == weight.device(), op, ": x is on ", x.device(), " but weight is on ", weight.device());
  TORCH_CHECK_TYPE(x.scalar_type() == weight.scalar_type(), op, ": x has dtype ", x.scalar_type(),
                   " but weight has dtype ", weight.scalar_type(), "; they must match");
  Subnet s;
  s.N = weight.size(0);
  s.K = weight.size(1);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->device() == weight.device(), op, ": bias is on ", bias->device(), " but weight is on ",
                      weight.device());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), op, ": bias has dtype ", bias->scalar_type(),
                     " but weight has dtype ", weight.scalar_type(), "; they must match");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == s.N, op, ": bias must have shape [", s.N,
                      "] (weight's out_features), got ", bias->sizes());
  }
  s.row_selected = check_index_list(rows, s.N, op, "rows", "weight dim 0 (out_features)", weight.device());
  check_index_list(cols, s.K, op, "cols", "weight dim 1 (in_features)", weight.device());
  s.all_rows = !rows.has_value();
  s.all_cols = !cols.has_value();
  if (rows.has_value()) {
    s.rows_c = rows->contiguous();
    s.rows = s.rows_c.const_data_ptr<int64_t>();
    s.Nr = s.rows_c.numel();
  } else {
    s.Nr = s.N;
  }
  if (cols.has_value()) {
    s.cols_c = cols->contiguous();
    s.cols = s.cols_c.const_data_ptr<int64_t>();
    s.Kc = s.cols_c.numel();
  } else {
    s.Kc = s.K;
  }
  TORCH_CHECK_VALUE(x.size(-1) == s.Kc, op, ": x has ", x.size(-1), " features but the subnetwork has ", s.Kc,
                    cols.has_value() ? " (len(cols))" : " (weight's in_features; cols is None)");
  return s;
}

// Rows of a tile per block: the tile (block x inner elements) stays in cache, and there are at
// least as many blocks as threads.
int64_t block_size(int64_t n, int64_t inner) {
  int64_t b = std::clamp<int64_t>((int64_t{1} << 16) / std::max<int64_t>(inner, 1), 8, 256);
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  if (n < b * threads) b = std::max<int64_t>(1, (n + threads - 1) / threads);
  return b;
}

// tile[j, k] = W[rows[r0 + j], cols[c0 + k]] for j < nr, k < nc; tile is row-major [nr, nc].
template <typename T>
void gather_tile(const T* w, int64_t sN, int64_t sK, const int64_t* rows, int64_t r0, int64_t nr,
                 const int64_t* cols, int64_t c0, int64_t nc, T* tile) {
  for (int64_t j = 0; j < nr; ++j) {
    const T* src = w + index_at(rows, r0 + j) * sN;
    T* dst = tile + j * nc;
    if (cols == nullptr && sK == 1) {
      std::memcpy(dst, src + c0, static_cast<size_t>(nc) * sizeof(T));
    } else {
      for (int64_t k = 0; k < nc; ++k) dst[k] = src[index_at(cols, c0 + k) * sK];
    }
  }
}

// Rows of x viewed as a matrix [M, features] (product of the leading dims; fine when features is 0).
int64_t leading(const at::Tensor& x) {
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  return m;
}

std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  auto v = sizes.vec();
  v.back() = last;
  return v;
}

}  // namespace

at::Tensor subnet_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& cols) {
  const NoAutocast no_autocast;
  const Subnet s = check_subnet("subnet_linear", x, weight, bias, rows, cols);
  // Inside the kernel nothing is differentiated (autograd is registered around the op); the
  // inputs are detached because at::parallel_for's worker threads have their own grad mode.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t M = leading(x);
  const auto x2 = x.detach().reshape({M, s.Kc}).contiguous();
  auto y = at::empty({M, s.Nr}, x.options());
  if (M == 0 || s.Nr == 0) return y.view(with_last(x.sizes(), s.Nr));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "subnet_linear", [&] {
    // b[rows], compact (Nr values: small).
    at::Tensor b;
    if (bias.has_value()) {
      const auto bc = bias->detach().contiguous();
      b = at::empty({s.Nr}, bias->options());
      const scalar_t* src = bc.const_data_ptr<scalar_t>();
      scalar_t* dst = b.data_ptr<scalar_t>();
      for (int64_t j = 0; j < s.Nr; ++j) dst[j] = src[index_at(s.rows, j)];
    }
    if (s.Kc == 0) {  // an empty subnetwork input: y = b[rows]
      if (b.defined()) y.copy_(b.unsqueeze(0).expand({M, s.Nr}));
      else y.zero_();
      return;
    }
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const int64_t sN = weight.stride(0), sK = weight.stride(1);
    const int64_t bn = block_size(s.Nr, s.Kc);
    const int64_t blocks = (s.Nr + bn - 1) / bn;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      auto tile = at::empty({bn, s.Kc}, weight.options());
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = blk * bn, nb = std::min(bn, s.Nr - n0);
        gather_tile(w, sN, sK, s.rows, n0, nb, s.cols, 0, s.Kc, tile.data_ptr<scalar_t>());
        auto out = y.narrow(1, n0, nb);
        const auto wt = tile.narrow(0, 0, nb).t();
        if (b.defined()) at::addmm_out(out, b.narrow(0, n0, nb).unsqueeze(0).expand({M, nb}), x2, wt);
        else at::mm_out(out, x2, wt);
      }
    });
  });
  return y.view(with_last(x.sizes(), s.Nr));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> subnet_linear_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& rows,
    const std::optional<at::Tensor>& cols, const c10::List<bool>& mask) {
  const NoAutocast no_autocast;
  constexpr const char* op = "subnet_linear_backward";
  const Subnet s = check_subnet(op, x, weight, std::nullopt, rows, cols);
  const std::array<bool, 3> output_mask = check_output_mask(mask, op);
  TORCH_CHECK_VALUE(grad_out.device() == weight.device(), op, ": grad_out is on ", grad_out.device(),
                    " but weight is on ", weight.device());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == weight.scalar_type(), op, ": grad_out has dtype ", grad_out.scalar_type(),
                   " but weight has dtype ", weight.scalar_type(), "; they must match");
  TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(with_last(x.sizes(), s.Nr)), op, ": grad_out must have shape ",
                    at::IntArrayRef(with_last(x.sizes(), s.Nr)), " (x's leading dims, len(rows) outputs), got ",
                    grad_out.sizes());
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in the forward
  const int64_t M = leading(x);
  const auto x2 = x.detach().reshape({M, s.Kc}).contiguous();
  const auto g2 = grad_out.detach().reshape({M, s.Nr}).contiguous();
  const auto opts = weight.options();
  at::Tensor grad_x = at::empty({0}, opts), grad_weight = at::empty({0}, opts), grad_bias = at::empty({0}, opts);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "subnet_linear_backward", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const int64_t sN = weight.stride(0), sK = weight.stride(1);

    if (output_mask[0]) {  // grad_x = g W[rows][:, cols], by blocks of input features
      grad_x = at::empty({M, s.Kc}, opts);
      if (M > 0 && s.Kc > 0 && s.Nr == 0) grad_x.zero_();
      if (M > 0 && s.Kc > 0 && s.Nr > 0) {
        const int64_t bk = block_size(s.Kc, s.Nr);
        const int64_t blocks = (s.Kc + bk - 1) / bk;
        at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
          auto tile = at::empty({s.Nr, bk}, opts);
          for (int64_t blk = b0; blk < b1; ++blk) {
            const int64_t k0 = blk * bk, kb = std::min(bk, s.Kc - k0);
            auto t = tile.narrow(1, 0, kb);  // [Nr, kb] with row stride bk
            scalar_t* tp = tile.data_ptr<scalar_t>();
            for (int64_t j = 0; j < s.Nr; ++j) {
              const scalar_t* src = w + index_at(s.rows, j) * sN;
              for (int64_t k = 0; k < kb; ++k) tp[j * bk + k] = src[index_at(s.cols, k0 + k) * sK];
            }
            auto out = grad_x.narrow(1, k0, kb);
            at::mm_out(out, g2, t);
          }
        });
      }
      grad_x = grad_x.view(x.sizes());
    }

    if (output_mask[1]) {  // grad_weight[rows, cols] = g^T x, by blocks of output features
      // With all columns selected, the selected rows are written whole: zero only the others.
      const bool all_cols = s.all_cols;
      grad_weight = all_cols && M > 0 ? at::empty({s.N, s.K}, opts) : at::zeros({s.N, s.K}, opts);
      scalar_t* gw = grad_weight.data_ptr<scalar_t>();
      if (all_cols && M > 0) {
        at::parallel_for(0, s.N, 16, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r)
            if (!index_marked(s.row_selected.data(), r)) std::fill(gw + r * s.K, gw + (r + 1) * s.K, scalar_t(0));
        });
      }
      if (M > 0 && s.Nr > 0 && s.Kc > 0) {
        const int64_t bn = block_size(s.Nr, s.Kc);
        const int64_t blocks = (s.Nr + bn - 1) / bn;
        at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
          auto tile = at::empty({bn, s.Kc}, opts);
          for (int64_t blk = b0; blk < b1; ++blk) {
            const int64_t n0 = blk * bn, nb = std::min(bn, s.Nr - n0);
            auto t = tile.narrow(0, 0, nb);
            at::mm_out(t, g2.narrow(1, n0, nb).t(), x2);
            const scalar_t* tp = tile.const_data_ptr<scalar_t>();
            for (int64_t j = 0; j < nb; ++j) {
              scalar_t* dst = gw + index_at(s.rows, n0 + j) * s.K;
              const scalar_t* src = tp + j * s.Kc;
              if (all_cols) std::memcpy(dst, src, static_cast<size_t>(s.Kc) * sizeof(scalar_t));
              else
                for (int64_t k = 0; k < s.Kc; ++k) dst[s.cols[k]] = src[k];
            }
          }
        });
      }
    }

    if (output_mask[2]) {  // grad_bias[rows] = sum over the batch of g
      grad_bias = at::zeros({s.N}, opts);
      if (M > 0 && s.Nr > 0) {
        const auto acc = weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
        const auto gsum = at::sum(g2, {0}, false, acc).to(weight.scalar_type());
        const scalar_t* src = gsum.const_data_ptr<scalar_t>();
        scalar_t* dst = grad_bias.data_ptr<scalar_t>();
        for (int64_t j = 0; j < s.Nr; ++j) dst[index_at(s.rows, j)] = src[j];
      }
    }
  });
  return {grad_x, grad_weight, grad_bias};
}

TORCH_LIBRARY_IMPL(ist_kernels, CPU, m) {
  m.impl("subnet_linear", &subnet_linear);
  m.impl("subnet_linear_backward", &subnet_linear_backward);
}

}  // namespace ist::cpu
