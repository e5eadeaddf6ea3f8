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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "vec.h"

#include <cmath>

namespace {

using namespace kvcache_vec;


at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm takes float32");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "rms_norm takes a contiguous x of at least one dimension");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(),
              "weight must be contiguous of shape (", n, ",)");
  at::Tensor y = at::empty_like(x);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  // Rows of a few kilobytes: one thread below about 64 KB of input.
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * n;
      float* yr = yp + r * n;
      v8 acc = {};
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const v8 v = load(xr + i);
        acc += v * v;
      }
      float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      for (; i < n; ++i) sum += xr[i] * xr[i];
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + feps);
      for (int64_t j = 0; j < n; ++j) yr[j] = wp[j] * (xr[j] * scale);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("rms_norm", rms_norm);
}
