// y = x W^T (+ b) on CPU from a weight packed once at load: a register-blocked product
// for any number of rows (a decode step's batch, a prefill chunk).
//
// Why: this model's products are short (K = 256 or 688) and narrow, the shapes where MKL
// reaches about a third of this machine's float32 peak (bench.attention_kernels, linear
// block: 64 x 256 -> 1,376 at 21-34 GFLOP/s, 2,048 rows at 31-51). A static weight can be
// laid out for the kernel once: panels of 16 output columns, K-major, so the inner loop
// loads two vectors of weights and broadcasts one element of each of kRows rows of x
// into 2 accumulators a row (kRows x 16 outputs held in registers for the whole of K).
//
// Numerics: every output is one fused multiply-add chain over k = 0..K-1 in order from
// zero, then + bias. That is the same for every row whatever the batch, its place in the
// batch or the thread count: a row's result never depends on the other rows of the step
// (batch invariance; tests/computed/test_kernels.py checks it). It agrees with F.linear to
// float32 rounding, not bit for bit (MKL sums in its own blocked order).
//
// kvcache::pack_linear_weight(weight) -> packed
//   weight (N, K)           float32, contiguous (an nn.Linear's weight)
//   packed (ceil(N/16), K, 16) float32: packed[p, k, j] = weight[16p + j, k], 0 past N
// kvcache::packed_linear(x, packed, bias, n) -> y
//   x      (M, K)   float32, contiguous
//   packed          as above, K matching x
//   bias   (n,)     float32 or None
//   n               the weight's N (16 * panels - 15 <= n <= 16 * panels)
//   y      (M, n)   float32

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <optional>

namespace {

using namespace kvcache_vec;

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-lane vectors
// Rows of x per register block: 2 accumulators a row + 2 weights + 1 broadcast. Six fill
// AVX2's 16 vector registers; with AVX-512's 32 (ymm16-31), eight: an 8-row decode step
// reads each panel once, not twice (6 + 2 rows). 2-core Zen 4, the default model's 17
// products: 8 rows 0.43 -> 0.35 ms, 16 rows 0.73 -> 0.65, 64 rows 2.66 -> 2.56, 2,048
// rows alike; 12 rows lost at 16 and 64.
#if defined(KVCACHE_V16)
constexpr int kRows = 8;
#else
constexpr int kRows = 6;
#endif
constexpr int64_t kChunkRows = 96;  // rows per task when there are many: x's chunk stays in L2

// y[r, 0..cols) (+ bias) for R rows of x against one panel.
template <int R>
inline void block(const float* x, int64_t k, const float* panel, const float* bias, float* y, int64_t n, int64_t cols) {
  v8 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = splat(0.f);
  for (int64_t i = 0; i < k; ++i) {
    const v8 w0 = load(panel + i * kPanel), w1 = load(panel + i * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const v8 a = splat(x[r * k + i]);
      lo[r] += a * w0;
      hi[r] += a * w1;
    }
  }
  if (bias != nullptr) {
    float b[kPanel] = {};
    std::copy(bias, bias + cols, b);
    const v8 b0 = load(b), b1 = load(b + 8);
    for (int r = 0; r < R; ++r) {
      lo[r] += b0;
      hi[r] += b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == kPanel) {
      store(y + r * n, lo[r]);
      store(y + r * n + 8, hi[r]);
    } else {
      float tmp[kPanel];
      store(tmp, lo[r]);
      store(tmp + 8, hi[r]);
      std::copy(tmp, tmp + cols, y + r * n);
    }
  }
}

// Rows [row_lo, row_hi) by panels [p_lo, p_hi): each panel (K x 16, in L1 for K <= 256)
// meets every row block of the range before the next panel is read.
void rows_by_panels(const float* x, const float* packed, const float* bias, float* y, int64_t k, int64_t n,
                    int64_t row_lo, int64_t row_hi, int64_t p_lo, int64_t p_hi) {
  for (int64_t p = p_lo; p < p_hi; ++p) {
    const float* panel = packed + p * k * kPanel;
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const float* b = bias != nullptr ? bias + col : nullptr;
    int64_t r = row_lo;
    for (; r + kRows <= row_hi; r += kRows) block<kRows>(x + r * k, k, panel, b, y + r * n + col, n, cols);
    static_assert(kRows <= 8, "the remainder cases below");
    switch (row_hi - r) {
      case 7: block<7>(x + r * k, k, panel, b, y + r * n + col, n, cols); break;
      case 6: block<6>(x + r * k, k, panel, b, y + r * n + col, n, cols); break;
      case 5: block<5>(x + r * k, k, panel, b, y + r * n + col, n, cols); break;
      case 4: block<4>(x + r * k, k, panel, b, y + r * n + col, n, cols); break;
      case 3: block<3>(x + r * k, k, panel, b, y + r * n + col, n, cols); break;
      case 2: block<2>(x + r * k, k, panel, b, y + r * n + col, n, cols); break;
      case 1: block<1>(x + r * k, k, panel, b, y + r * n + col, n, cols); break;
      default: break;
    }
  }
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "pack_linear_weight takes a contiguous float32 weight (N, K)");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, k, kPanel}, weight.options());
  const float* w = weight.data_ptr<float>();
  float* out = packed.data_ptr<float>();
  for (int64_t c = 0; c < n; ++c)
    for (int64_t i = 0; i < k; ++i) out[(c / kPanel) * k * kPanel + i * kPanel + c % kPanel] = w[c * k + i];
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "packed_linear takes contiguous float32 x (M, K)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(),
              "packed_linear takes a weight from pack_linear_weight");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " columns, the packed weight ", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n = ", n, " does not fit ", panels, " panels");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be contiguous float32 of shape (", n, ",)");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  // Tasks: row chunks x panel groups, enough of them (4 per thread) to even out the work.
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t groups = std::min(panels, std::max<int64_t>(1, (4 * threads + chunks - 1) / chunks));
  const int64_t tasks = chunks * groups;
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunk = t / groups, group = t % groups;
      const int64_t row_lo = chunk * kChunkRows, row_hi = std::min(m, row_lo + kChunkRows);
      rows_by_panels(xp, wp, bp, yp, k, n, row_lo, row_hi, panels * group / groups, panels * (group + 1) / groups);
    }
  };
  if (threads == 1 || tasks == 1) {
    run(0, tasks);
  } else {
    at::parallel_for(0, tasks, 1, run);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("packed_linear", packed_linear);
}
