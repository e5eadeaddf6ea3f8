// RMSNorm of a decode step's few rows on CPU in one call: y = weight * (x / sqrt(mean(x^2) + eps)).
//
// Why: torch runs the norm as seven small ops (float, pow, mean, add, rsqrt, mul, mul),
// each a dispatch of several microseconds on a tensor of a few kilobytes; a decode step of
// the default model runs nine norms (`computed/model/layers.py` uses this op for at most
// 16 rows, where dispatch is the cost; longer inputs keep torch's ops, bit for bit).
// Numerics: float32, the sum of squares in 8 lane-wise partial sums added in a fixed
// order (torch's reduction order differs: float32 rounding, not bit for bit); then, as
// Hugging Face does, x times the reciprocal square root, then times the weight.
//
// kvcache::rms_norm(x, weight, eps) -> y
//   x      (..., N)  float32, contiguous
//   weight (N,)      float32
//   y      (..., N)  float32

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }

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
  for (int64_t r = 0; r < rows; ++r) {
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
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("rms_norm", rms_norm);
}
