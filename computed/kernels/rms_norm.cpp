// RMSNorm on CPU in one call: y = weight * (x / sqrt(mean(x^2) + eps)), rows split across
// torch's threads.
//
// Why: torch runs the norm as seven ops (float, pow, mean, add, rsqrt, mul, mul): on a
// decode step's few kilobytes each is a dispatch of several microseconds (a step of the
// default model runs nine norms: 8 x 256 95 -> ~10 us, 64 x 256 170 -> ~10 us), on a
// prefill's rows each op is a pass over memory (one pass here).
// Numerics: float32, the sum of squares in 8 lane-wise partial sums added in a fixed
// order (torch's reduction order differs: float32 rounding, not bit for bit); then, as
// Hugging Face does, x times the reciprocal square root, then times the weight.
//
// kvcache::rms_norm(x, weight, eps) -> y
//   x      (..., N)  float32, contiguous
//   weight (N,)      float32
//   y      (..., N)  float32
// kvcache::add_rms_norm(x, residual, weight, eps) -> (y, sum)
//   sum = x + residual (as torch adds them), y = rms_norm(sum, weight, eps): a decoder
//   layer's residual add and the next norm in one pass, bit for bit the two calls.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

using namespace kvcache_vec;


// One row: y = weight * (x * (1 / sqrt(mean(x^2) + eps))).
inline void norm_row(const float* xr, const float* wp, float* yr, int64_t n, float eps) {
  v8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load(xr + i);
    acc += v * v;
  }
  float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) sum += xr[i] * xr[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) yr[j] = wp[j] * (xr[j] * scale);
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm takes float32");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "rms_norm takes a contiguous x of at least one dimension");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(),
              "weight must be contiguous of shape (", n, ",)");
}

// Rows of a few kilobytes: one thread below about 64 KB of input.
inline int64_t grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const int64_t n = x.size(-1);
  at::Tensor y = at::empty_like(x);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  kvcache_par::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, yp + r * n, n, feps);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "add_rms_norm takes a contiguous float32 residual shaped like x");
  const int64_t n = x.size(-1);
  at::Tensor y = at::empty_like(x);
  at::Tensor sum = at::empty_like(x);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  kvcache_par::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* sr = sp + r * n;
      for (int64_t j = 0; j < n; ++j) sr[j] = xp[r * n + j] + rp[r * n + j];
      norm_row(sr, wp, yp + r * n, n, feps);
    }
  });
  return {y, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
}
