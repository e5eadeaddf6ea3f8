// y = x W^T (+ b) on CPU: a decode step's few rows by a native dot-product kernel, wide
// products with the output columns split across torch's threads.
//
// Few rows (M <= kSmallRows: a decode step's batch): MKL streams the weights through one
// core there, and a step's K/V reads have evicted them from cache, so the product waits
// on memory. Here every thread takes a block of output columns (its own rows of W) and
// takes the dot products of up to 4 rows of x with 3 rows of W at once, 8 lanes wide:
// each weight is loaded once for all the rows. `python -m bench.attention_kernels`,
// linear block, on the 2-core bench machine, from cold caches: 8 x 256 -> 688 0.32 ->
// 0.19 ms, 8 x 256 -> 4,096 1.43 -> 0.84 ms; a chat decode step of the default model
// (8 rows) 18-23% less time.
// Numerics: float32 accumulation in 8 lane-wise partial sums added in a fixed order, so
// up to 16 rows a row's result does not depend on the other rows of the batch (MKL's does:
// it takes another path for one or two rows; from 17 rows on, MKL computes it again, to
// its own rounding); it agrees with F.linear to float32 rounding, not bit for bit.
//
// Wide products (N >= kMinSplitColumns, the vocabulary projection): MKL runs a short,
// wide product on about one core. Giving each thread a block of output columns keeps
// every core busy on its own weights: 8 x 256 -> 4,096 took 0.69 ms against MKL's
// 1.26 ms, 64 rows 2.92 against 3.68 ms. Each output element is still one MKL dot product
// over all of K with the same kernel as an unsplit `F.linear` (a column split does not
// change the reduction): bit-identical, which tests/computed/test_kernels.py checks.
// Narrower products with more rows go to MKL unchanged.
//
// kvcache::linear(x, weight, bias) -> y
//   x      (M, K)   float32, contiguous
//   weight (N, K)   float32, contiguous (an nn.Linear's weight)
//   bias   (N,)     float32 or None
//   y      (M, N)   float32

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cstring>
#include <optional>

namespace {

using namespace kvcache_vec;

// At most this many rows take the dot-product kernel (measured: MKL wins from 32 rows on).
constexpr int64_t kSmallRows = 16;


// out[r, c] = x[r, :] . w[c, :] for R rows of x (row stride k) and C rows of w.
template <int R, int C>
inline void dot_tile(const float* x, const float* w, float* out, int64_t k, int64_t n) {
  v8 acc[R][C] = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    v8 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(w + c * k + i);
    for (int r = 0; r < R; ++r) {
      const v8 xv = load(x + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const v8 a = acc[r][c];
      float sum = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
      for (int64_t j = i; j < k; ++j) sum += x[r * k + j] * w[c * k + j];
      out[r * n + c] = sum;
    }
}

// Columns [lo, hi) of y for every row.
void small_rows(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
                int64_t lo, int64_t hi) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) {
    int64_t c = lo;
    for (; c + 3 <= hi; c += 3) dot_tile<4, 3>(x + r * k, w + c * k, y + r * n + c, k, n);
    for (; c < hi; ++c) dot_tile<4, 1>(x + r * k, w + c * k, y + r * n + c, k, n);
  }
  for (; r < m; ++r) {
    int64_t c = lo;
    for (; c + 3 <= hi; c += 3) dot_tile<1, 3>(x + r * k, w + c * k, y + r * n + c, k, n);
    for (; c < hi; ++c) dot_tile<1, 1>(x + r * k, w + c * k, y + r * n + c, k, n);
  }
  if (bias != nullptr)
    for (int64_t row = 0; row < m; ++row)
      for (int64_t c = lo; c < hi; ++c) y[row * n + c] += bias[c];
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  // Column blocks of at least 48 columns (whole 3-column tiles) per thread.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 48));
  if (parts == 1 || at::in_parallel_region()) {
    small_rows(xp, wp, bp, yp, m, k, n, 0, n);
    return out;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lo = n * p / parts / 3 * 3, hi = p + 1 == parts ? n : n * (p + 1) / parts / 3 * 3;
      small_rows(xp, wp, bp, yp, m, k, n, lo, hi);
    }
  });
  return out;
}

// Column blocks are multiples of this many columns (whole SIMD registers of output).
constexpr int64_t kColumnAlign = 16;
// Narrower outputs go to MKL whole (it threads them as well as a split; measured above).
constexpr int64_t kMinSplitColumns = 2048;

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear takes x (M, K) and weight (N, K)");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "linear takes float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "linear takes contiguous tensors");
  const int64_t n = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be contiguous float32 of shape (", n, ",)");
  }
  if (x.size(0) <= kSmallRows) return small_linear(x, weight, bias);
  const int64_t parts = n < kMinSplitColumns ? 1 : std::min<int64_t>(at::get_num_threads(), n / kColumnAlign);
  if (parts <= 1 || at::in_parallel_region()) {
    return bias.has_value() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
  }
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  // Part p covers columns [bound(p), bound(p + 1)), aligned; the last one ends at n.
  auto bound = [&](int64_t p) {
    return p == parts ? n : (n * p / parts) / kColumnAlign * kColumnAlign;
  };
  // The worker threads run ATen ops on the caller's tensors: they need its thread-local
  // state (inference mode, dispatch keys), which at::parallel_for does not carry over.
  const at::ThreadLocalState caller;
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(caller);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lo = bound(p), width = bound(p + 1) - lo;
      at::Tensor columns = out.narrow(1, lo, width);  // (M, width), row stride n: written in place
      at::Tensor w = weight.narrow(0, lo, width).t();
      if (bias.has_value()) {
        at::addmm_out(columns, bias->narrow(0, lo, width), x, w);
      } else {
        at::mm_out(columns, x, w);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("linear", linear);
}
