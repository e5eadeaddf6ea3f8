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
// A weight whose every value is a bfloat16 (a bf16 checkpoint loaded as float32) can be
// packed at half the bytes and widened back exactly in the inner loop (a bfloat16 is the
// top half of its float32): the same products bit for bit, while a decode step, which
// reads every weight back from memory (its K/V reads evict them from cache), reads half
// (`python -m bench.attention_kernels`, linear block: "bf16-packed", cold).
//
// kvcache::pack_linear_weight(weight) -> packed
//   weight (N, K)           float32, contiguous (an nn.Linear's weight)
//   packed (ceil(N/16), K, 16) float32: packed[p, k, j] = weight[16p + j, k], 0 past N
// kvcache::pack_linear_weight_bf16(weight) -> packed
//   weight (N, K)           float32, contiguous, every value a bfloat16 (checked)
//   packed (ceil(N/16), K, 8) int32: the top 16 bits of weight[16p + j, k] in the low
//                           half of packed[p, k, j], of weight[16p + 8 + j, k] in the high
// kvcache::packed_linear(x, packed, bias, n) -> y
//   x      (M, K)   float32, contiguous
//   packed          either of the above, K matching x
//   bias   (n,)     float32 or None
//   n               the weight's N (16 * panels - 15 <= n <= 16 * panels)
//   y      (M, n)   float32
// kvcache::packed_linear_swiglu(x, packed, n) -> y
//   x, packed       as packed_linear's, packed from a fused gate/up weight (N = n = 2I:
//                   the gate's I rows, then the up's, I a multiple of 16)
//   y      (M, I)   float32, silu(x Wg^T) * (x Wu^T): silu_mul(packed_linear(x, packed,
//                   None, n)) bit for bit, without the (M, 2I) product in memory
//
// Why the fused op: in a prefill step the (M, 2I) product is megabytes, written by the
// product and read back by silu_mul from beyond L2. The built-in model's 2,048-token
// prefill step, interleaved A/B in one process: 103.3 -> 96.9 ms and 96.5 -> 93.3 ms
// (medians of 10 and 16); decode steps alike (64 and 8 rows). Hot and alone the pair
// gains less (`python -m bench.attention_kernels`, linear block, "swiglu": 7.2 -> 7.0 ms).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

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

typedef unsigned v8u32u __attribute__((vector_size(32), aligned(4)));

// A packed panel's row i as its two vectors of 8 float32 weights.
inline void weights(const float* panel, int64_t i, v8& w0, v8& w1) {
  w0 = load(panel + i * kPanel);
  w1 = load(panel + i * kPanel + 8);
}

// The same from a bfloat16 panel: low halves widened (shifted up), high halves masked.
inline void weights(const uint32_t* panel, int64_t i, v8& w0, v8& w1) {
  const v8u32 word = *reinterpret_cast<const v8u32u*>(panel + i * (kPanel / 2));
  const v8u32 low = word << 16, high = word & 0xFFFF0000u;
  std::memcpy(&w0, &low, sizeof(w0));
  std::memcpy(&w1, &high, sizeof(w1));
}

// lo[r], hi[r] = x[r, :] . the panel's 16 columns, for R rows of x (W: float, or uint32_t
// for bf16): one multiply-add chain over k = 0..K-1 in order from zero per output.
template <int R, class W>
inline void accumulate(const float* x, int64_t k, const W* panel, v8* lo, v8* hi) {
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = splat(0.f);
  for (int64_t i = 0; i < k; ++i) {
    v8 w0, w1;
    weights(panel, i, w0, w1);
    for (int r = 0; r < R; ++r) {
      const v8 a = splat(x[r * k + i]);
      lo[r] += a * w0;
      hi[r] += a * w1;
    }
  }
}

// y[r, 0..cols) (+ bias) for R rows of x against one panel.
template <int R, class W>
inline void block(const float* x, int64_t k, const W* panel, const float* bias, float* y, int64_t n, int64_t cols) {
  v8 lo[R], hi[R];
  accumulate<R>(x, k, panel, lo, hi);
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

// f(std::integral_constant<int, R>, r) for the blocks of R rows starting at r that cover
// [row_lo, row_hi): kRows at a time, then one block of the rest.
template <class F>
inline void for_row_blocks(int64_t row_lo, int64_t row_hi, F f) {
  int64_t r = row_lo;
  for (; r + kRows <= row_hi; r += kRows) f(std::integral_constant<int, kRows>{}, r);
  static_assert(kRows <= 8, "the remainder cases below");
  switch (row_hi - r) {
    case 7: f(std::integral_constant<int, 7>{}, r); break;
    case 6: f(std::integral_constant<int, 6>{}, r); break;
    case 5: f(std::integral_constant<int, 5>{}, r); break;
    case 4: f(std::integral_constant<int, 4>{}, r); break;
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Rows [row_lo, row_hi) by panels [p_lo, p_hi): each panel (K x 16, in L1 for K <= 256)
// meets every row block of the range before the next panel is read.
template <class W>
void rows_by_panels(const float* x, const W* packed, const float* bias, float* y, int64_t k, int64_t n,
                    int64_t row_lo, int64_t row_hi, int64_t p_lo, int64_t p_hi) {
  constexpr int64_t kWords = std::is_same_v<W, float> ? kPanel : kPanel / 2;  // per row of a panel
  for (int64_t p = p_lo; p < p_hi; ++p) {
    const W* panel = packed + p * k * kWords;
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const float* b = bias != nullptr ? bias + col : nullptr;
    for_row_blocks(row_lo, row_hi, [&](auto rows, int64_t r) {
      block<decltype(rows)::value>(x + r * k, k, panel, b, y + r * n + col, n, cols);
    });
  }
}

// SwiGLU's activation in the product's epilogue: y[r, c] = silu(g) * u for the gate's
// output g = x[r] . W[c] and the up's u = x[r] . W[c + I], for R rows of x and the 16
// columns of one panel pair (the gate's panel p and the up's panel p + I / 16). Each of g
// and u is the chain `accumulate` computes, and silu(g) * u is silu_mul.cpp's expression:
// the same values, bit for bit, as packed_linear then silu_mul.
template <int R, class W>
inline void swiglu_block(const float* x, int64_t k, const W* gate_panel, const W* up_panel, float* y, int64_t n) {
  v8 lo[R], hi[R];
  accumulate<R>(x, k, gate_panel, lo, hi);
  float gate[R][kPanel];  // to L1: the up panel's accumulators need the registers
  for (int r = 0; r < R; ++r) {
    store(gate[r], lo[r]);
    store(gate[r] + 8, hi[r]);
  }
  accumulate<R>(x, k, up_panel, lo, hi);
  const v8 one = splat(1.f);
  for (int r = 0; r < R; ++r) {
    const v8 g0 = load(gate[r]), g1 = load(gate[r] + 8);
    store(y + r * n, g0 / (one + exp_any(-g0)) * lo[r]);
    store(y + r * n + 8, g1 / (one + exp_any(-g1)) * hi[r]);
  }
}

// Rows [row_lo, row_hi) by output panels [p_lo, p_hi) of y (M, n), n = I a multiple of 16.
template <class W>
void swiglu_rows_by_panels(const float* x, const W* packed, float* y, int64_t k, int64_t n, int64_t row_lo,
                           int64_t row_hi, int64_t p_lo, int64_t p_hi) {
  constexpr int64_t kWords = std::is_same_v<W, float> ? kPanel : kPanel / 2;
  const int64_t up_offset = (n / kPanel) * k * kWords;
  for (int64_t p = p_lo; p < p_hi; ++p) {
    const W* gate = packed + p * k * kWords;
    const int64_t col = p * kPanel;
    for_row_blocks(row_lo, row_hi, [&](auto rows, int64_t r) {
      swiglu_block<decltype(rows)::value>(x + r * k, k, gate, gate + up_offset, y + r * n + col, n);
    });
  }
}

// The products' tasks: row chunks x panel groups, enough of them (4 per thread) to even
// out the work; `run_task(row_lo, row_hi, p_lo, p_hi)` does one.
template <class F>
void parallel_tasks(int64_t m, int64_t panels, F run_task) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t groups = std::min(panels, std::max<int64_t>(1, (4 * threads + chunks - 1) / chunks));
  const int64_t tasks = chunks * groups;
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunk = t / groups, group = t % groups;
      const int64_t row_lo = chunk * kChunkRows, row_hi = std::min(m, row_lo + kChunkRows);
      run_task(row_lo, row_hi, panels * group / groups, panels * (group + 1) / groups);
    }
  };
  if (threads == 1 || tasks == 1) {
    run(0, tasks);
  } else {
    at::parallel_for(0, tasks, 1, run);
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

at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "pack_linear_weight_bf16 takes a contiguous float32 weight (N, K)");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(weight.data_ptr<float>());
  for (int64_t a = 0; a < n * k; ++a)
    TORCH_CHECK((w[a] & 0xFFFFu) == 0, "pack_linear_weight_bf16: weight value ", a, " is not a bfloat16");
  at::Tensor packed = at::zeros({panels, k, kPanel / 2}, weight.options().dtype(at::kInt));
  uint32_t* out = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  for (int64_t c = 0; c < n; ++c) {
    const int64_t j = c % kPanel, lane = j % (kPanel / 2);
    for (int64_t i = 0; i < k; ++i) {
      uint32_t& word = out[(c / kPanel) * k * (kPanel / 2) + i * (kPanel / 2) + lane];
      word |= j < kPanel / 2 ? w[c * k + i] >> 16 : w[c * k + i];
    }
  }
  return packed;
}

// A packed product's inputs, checked for `op`: x contiguous float32 (M, K), packed from
// pack_linear_weight or pack_linear_weight_bf16 with K matching. Returns its weights: one
// of the two pointers, the other null.
struct PackedWeights {
  const float* f32;
  const uint32_t* bf16;
};

PackedWeights check_product(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              " takes contiguous float32 x (M, K)");
  const bool bf16 = packed.scalar_type() == at::kInt;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  ((packed.scalar_type() == at::kFloat && packed.size(2) == kPanel) ||
                   (bf16 && packed.size(2) == kPanel / 2)),
              op, " takes a weight from pack_linear_weight or pack_linear_weight_bf16");
  TORCH_CHECK(packed.size(1) == x.size(1), "x has ", x.size(1), " columns, the packed weight ", packed.size(1));
  if (bf16) return {nullptr, reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>())};
  return {packed.data_ptr<float>(), nullptr};
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  const PackedWeights w = check_product("packed_linear", x, packed);
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n = ", n, " does not fit ", panels, " panels");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be contiguous float32 of shape (", n, ",)");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  parallel_tasks(m, panels, [&](int64_t row_lo, int64_t row_hi, int64_t p_lo, int64_t p_hi) {
    if (w.bf16 != nullptr)
      rows_by_panels(xp, w.bf16, bp, yp, k, n, row_lo, row_hi, p_lo, p_hi);
    else
      rows_by_panels(xp, w.f32, bp, yp, k, n, row_lo, row_hi, p_lo, p_hi);
  });
  return y;
}

at::Tensor packed_linear_swiglu(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const PackedWeights w = check_product("packed_linear_swiglu", x, packed);
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(n == panels * kPanel && n % (2 * kPanel) == 0, "packed_linear_swiglu needs the gate's and the up's ",
              "rows, each a multiple of ", kPanel, ", as the weight's n; got n = ", n, " for ", panels, " panels");
  const int64_t width = n / 2;
  at::Tensor y = at::empty({m, width}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_tasks(m, width / kPanel, [&](int64_t row_lo, int64_t row_hi, int64_t p_lo, int64_t p_hi) {
    if (w.bf16 != nullptr)
      swiglu_rows_by_panels(xp, w.bf16, yp, k, width, row_lo, row_hi, p_lo, p_hi);
    else
      swiglu_rows_by_panels(xp, w.f32, yp, k, width, row_lo, row_hi, p_lo, p_hi);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("pack_linear_weight_bf16(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("packed_linear_swiglu(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("pack_linear_weight_bf16", pack_linear_weight_bf16);
  m.impl("packed_linear", packed_linear);
  m.impl("packed_linear_swiglu", packed_linear_swiglu);
}
