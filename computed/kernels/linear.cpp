// y = x W^T (+ b) on CPU with the output columns split across torch's threads.
//
// Why: MKL runs a wide, short product (the vocabulary projection of a decode step: M = the
// step's rows, N = 4,096 columns) on about one core. Giving each thread a block of output
// columns (its own rows of W) keeps every core busy on its own weights: on the 2-core bench
// machine (`python -m bench.attention_kernels`, linear block) 8 x 256 -> 4,096 took 0.69 ms
// against MKL's 1.26 ms, 64 rows 2.92 against 3.68 ms. Narrower products (N < 2,048) MKL
// splits as well itself: they go to it unchanged.
//
// Exactness: each output element is still one MKL dot product over all of K with the same
// kernel as an unsplit `torch.nn.functional.linear` (a column split does not change the
// reduction); tests/computed/test_kernels.py checks the results are bit-identical.
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

#include <algorithm>
#include <optional>

namespace {

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
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "bias must be float32 of shape (", n, ",)");
  }
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
