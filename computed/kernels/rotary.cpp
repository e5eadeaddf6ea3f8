// Rotary position embedding (rotate-half) of q and k in one call, bit for bit what
// `computed.model.rope.apply_rotary` computes with torch ops.
//
// Why: applied with torch ops it is five elementwise kernels per tensor (neg, cat, two
// muls, add) plus their views, twice per layer; a decode step's tensors are tiny, so the
// per-op dispatch is the cost. Measured with `python -m bench.attention_kernels` (rotary
// block) and `python -m bench --only peer` (BENCHMARKS.md).
//
// Exactness: out = x * cos + rotated * sin, each product rounded to float, then the sum
// rounded, as torch's three separate kernels do. This file must not contract a * b + c * d
// into a fused multiply-add (one rounding instead of three): fp-contract is off below.
//
// kvcache::rotary(q, k, cos, sin) -> (q', k')
//   q    (T, H, D)    float32, rows of D contiguous (a view with other strides is fine)
//   k    (T, Hkv, D)  float32, likewise
//   cos  (T, D)       float32, contiguous: the table rows of each token's position
//   sin  (T, D)       float32, contiguous

#pragma GCC optimize("fp-contract=off")

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "parallel.h"

#include <tuple>

namespace {

void rotate(const at::Tensor& x, const float* cos, const float* sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  kvcache_par::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* __restrict xi = xp + t * st + h * sh;
        float* __restrict oi = op + (t * heads + h) * dim;
        for (int64_t d = 0; d < half; ++d) {
          const float a = xi[d] * c[d];
          const float b = -xi[d + half] * s[d];
          oi[d] = a + b;
        }
        for (int64_t d = half; d < dim; ++d) {
          const float a = xi[d] * c[d];
          const float b = xi[d - half] * s[d];
          oi[d] = a + b;
        }
      }
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, name, " must be float32 (T, heads, D)");
  TORCH_CHECK(x.size(2) % 2 == 0 && x.stride(2) == 1, name, "'s last dimension must be even and contiguous");
  TORCH_CHECK(x.size(0) == cos.size(0) && x.size(2) == cos.size(1), name, " (T, heads, D) disagrees with cos (T, D)");
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.scalar_type() == at::kFloat && cos.is_contiguous(),
              "cos must be contiguous float32 (T, D)");
  TORCH_CHECK(sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "sin must be contiguous float32 shaped like cos");
  check(q, cos, "q");
  check(k, cos, "k");
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  rotate(q, cos.data_ptr<float>(), sin.data_ptr<float>(), q_out);
  rotate(k, cos.data_ptr<float>(), sin.data_ptr<float>(), k_out);
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("rotary", rotary);
}
