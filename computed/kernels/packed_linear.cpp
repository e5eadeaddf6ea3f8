// y = x W^T (+ b) on CPU from a weight packed once at load: a register-blocked product
// for any number of rows (a decode step's batch, a prefill chunk).
//
// Why: this model's products are short (K = 256 or 688) and narrow, the shapes where MKL
// reaches about a third of this machine's float32 peak (bench.attention_kernels, linear
// block: 64 x 256 -> 1,376 at 21-34 GFLOP/s, 2,048 rows at 31-51). A static weight can be
// laid out for the kernel once: panels of 16 output columns, K-major, so the inner loop
// loads a panel row of weights (one 16-lane vector with AVX-512, two 8-lane ones with AVX2)
// and broadcasts one element of each of kRows rows of x into its accumulators (kRows x 16
// outputs held in registers for the whole of K).
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
// kvcache::pack_linear_weight_bf16_dot(weight) -> packed
//   weight (N, K)           bfloat16, contiguous
//   packed (ceil(N/16), ceil(K/2), 32) bfloat16: packed[p, i, 2j + e] = weight[16p + j, 2i + e],
//                           0 past N and K: each 32-bit word two weights of one column
// kvcache::packed_linear(x, packed, bias, n) -> y
//   x      (M, K)   float32, contiguous
//   packed          any of the above, K matching x
//   bias   (n,)     float32 or None
//   n               the weight's N (16 * panels - 15 <= n <= 16 * panels)
//   y      (M, n)   float32
// kvcache::packed_linear_swiglu(x, packed, n) -> y
//   x, packed       as packed_linear's, packed from a fused gate/up weight (N = n = 2I:
//                   the gate's I rows, then the up's, I a multiple of 16)
//   y      (M, I)   float32, silu(x Wg^T) * (x Wu^T): silu_mul(packed_linear(x, packed,
//                   None, n)) bit for bit, without the (M, 2I) product in memory
//
// Products in bfloat16 (a weight from pack_linear_weight_bf16_dot): x is rounded to
// bfloat16 first (to nearest even, exactly `x.to(torch.bfloat16)`), and each output is one
// chain over the pairs i = 0..ceil(K/2)-1 in order from zero: acc += x[2i+1] w[2i+1], then
// acc += x[2i] w[2i], each add rounded to float32 (a product of two bfloat16 values is exact
// in float32). That is what AVX512_BF16's vdpbf16ps does per lane (checked against it on this
// machine's Zen 4 over 3.2M random lanes, all equal), so it runs one instruction per 16
// products where float32 needs one per 8: twice the products per cycle on the same FMA
// ports (zmm FMA 117 GFLOP/s a core, vdpbf16ps 234). Without AVX512_BF16 the same chain runs
// as two float32 FMAs (bit for bit, denormals aside: the instruction flushes them). Batch
// invariant as the float32 products; it agrees with float32 products to bfloat16 rounding
// of the inputs, which is what `--dtype bfloat16` asks for.
//
// Why the fused op: in a prefill step the (M, 2I) product is megabytes, written by the
// product and read back by silu_mul from beyond L2. The built-in model's 2,048-token
// prefill step, interleaved A/B in one process: 103.3 -> 96.9 ms and 96.5 -> 93.3 ms
// (medians of 10 and 16); decode steps alike (64 and 8 rows). Hot and alone the pair
// gains less (`python -m bench.attention_kernels`, linear block, "swiglu": 7.2 -> 7.0 ms).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "parallel.h"
#include "vec.h"

#if (defined(__AVX512BF16__) && defined(__AVX512VL__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

namespace {

using namespace kvcache_vec;

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-lane vectors
// Rows of x per register block. 8-lane (AVX2): 2 accumulators a row + 2 weights + 1
// broadcast; six fill the 16 vector registers. 16-lane (AVX-512, one accumulator a row,
// `accumulate16`): twelve of the 32, so each weight vector loaded feeds 12 FMAs (8 rows: 9
// loads for 8 FMAs, bound by the loads). 2-core Zen 5 (family 26), x (M, K) W^T in GFLOP/s,
// float32 / bfloat16 products, against the 8-lane kernel at 8 rows: 2,048 x 256 -> 1,376
// 244 / 445 -> 431 / 799; 64 rows 251 / 484 -> 414 / 724; 16 rows a block lost to 12
// (396 / 741 at 2,048).
#if defined(KVCACHE_V16)
constexpr int kRows = 12;
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

// Two bfloat16 weights of one output column in a dot-packed panel: k = 2i in the low half,
// 2i + 1 in the high (the pair vdpbf16ps multiplies with x's pair in the same halves).
struct DotWord {
  uint32_t bits;
};
static_assert(sizeof(DotWord) == 4);

// x rounded to bfloat16 pairs: xw[r, i] = bf16(x[r, 2i]) | bf16(x[r, 2i + 1]) << 16 for rows
// [row_lo, row_hi), 0 past K, each rounded as torch rounds (`round_bf16`).
void round_rows(const float* x, uint32_t* xw, int64_t k, int64_t row_lo, int64_t row_hi) {
  const int64_t k2 = (k + 1) / 2;
  for (int64_t r = row_lo; r < row_hi; ++r) {
    const float* in = x + r * k;
    uint16_t* out = reinterpret_cast<uint16_t*>(xw + r * k2);  // the pairs' halves in k order
    for (int64_t i = 0; i < k; ++i) out[i] = round_bf16(in[i]);
    if (k % 2 == 1) out[k] = 0;
  }
}

// lo[r], hi[r] = xw[r, :] . the dot panel's 16 columns, for R rows of bfloat16 pairs (K2
// words a row): the chain the header describes, odd half of each pair before the even.
template <int R>
inline void accumulate(const uint32_t* xw, int64_t k2, const DotWord* panel, v8* lo, v8* hi) {
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = splat(0.f);
  for (int64_t i = 0; i < k2; ++i) {
    const uint32_t* w = &panel[i * kPanel].bits;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const __m256bh w0 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256bh w1 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8));
    for (int r = 0; r < R; ++r) {
      const __m256bh a = (__m256bh)_mm256_set1_epi32(static_cast<int>(xw[r * k2 + i]));
      lo[r] = (v8)_mm256_dpbf16_ps((__m256)lo[r], a, w0);
      hi[r] = (v8)_mm256_dpbf16_ps((__m256)hi[r], a, w1);
    }
#else
    v8u32 word0, word1;
    std::memcpy(&word0, w, sizeof(word0));
    std::memcpy(&word1, w + 8, sizeof(word1));
    const v8u32 odd0 = word0 & 0xFFFF0000u, even0 = word0 << 16, odd1 = word1 & 0xFFFF0000u, even1 = word1 << 16;
    v8 wo0, we0, wo1, we1;
    std::memcpy(&wo0, &odd0, sizeof(v8));
    std::memcpy(&we0, &even0, sizeof(v8));
    std::memcpy(&wo1, &odd1, sizeof(v8));
    std::memcpy(&we1, &even1, sizeof(v8));
    for (int r = 0; r < R; ++r) {
      const uint32_t pair = xw[r * k2 + i];
      const uint32_t odd_bits = pair & 0xFFFF0000u, even_bits = pair << 16;
      float odd, even;
      std::memcpy(&odd, &odd_bits, sizeof(odd));
      std::memcpy(&even, &even_bits, sizeof(even));
      // Each product is exact in float32, so a multiply then an add rounds as an FMA does.
      lo[r] += splat(odd) * wo0;
      hi[r] += splat(odd) * wo1;
      lo[r] += splat(even) * we0;
      hi[r] += splat(even) * we1;
    }
#endif
  }
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

#if defined(KVCACHE_V16)
// The same chains with one 16-lane vector a row (a panel's 16 columns in order) where
// AVX-512 is: a 512-bit FMA does the work of two 256-bit ones on a core with full-width
// units (this machine's Zen 5: 264 against 124 GFLOP/s a core, a register-resident FMA
// loop), and the same work in the same order on one that splits them (Zen 4). Each output
// is still its one chain over k in order, so the results are the 8-lane path's bit for bit.
inline v16 joined(v8 lo, v8 hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

inline v16 weights16(const float* panel, int64_t i) { return load16(panel + i * kPanel); }

// A bfloat16 panel's row as 16 float32 weights in the words' order, columns interleaved
// (lane 2j: column j, lane 2j + 1: column j + 8): one widening load and a shift, where the
// columns' own order took two more shuffles a k. `deinterleaved` puts a row's sums back.
inline v16 weights16(const uint32_t* panel, int64_t i) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + i * (kPanel / 2)));
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16);
}

template <class W>
constexpr bool interleaved() {
  return std::is_same_v<W, uint32_t>;
}

inline v16 deinterleaved(v16 acc) {
  return __builtin_shufflevector(acc, acc, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
}

template <int R, class W>
inline void accumulate16(const float* x, int64_t k, const W* panel, v16* acc) {
  for (int r = 0; r < R; ++r) acc[r] = splat16(0.f);
  for (int64_t i = 0; i < k; ++i) {
    const v16 w = weights16(panel, i);
    for (int r = 0; r < R; ++r) acc[r] += splat16(x[r * k + i]) * w;
  }
  if constexpr (interleaved<W>()) {
    for (int r = 0; r < R; ++r) acc[r] = deinterleaved(acc[r]);
  }
}

template <int R>
inline void accumulate16(const uint32_t* xw, int64_t k2, const DotWord* panel, v16* acc) {
#if defined(__AVX512BF16__)
  for (int r = 0; r < R; ++r) acc[r] = splat16(0.f);
  for (int64_t i = 0; i < k2; ++i) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(&panel[i * kPanel].bits);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xw[r * k2 + i]));
      acc[r] = (v16)_mm512_dpbf16_ps((__m512)acc[r], a, w);
    }
  }
#else
  v8 lo[R], hi[R];
  accumulate<R>(xw, k2, panel, lo, hi);
  for (int r = 0; r < R; ++r) acc[r] = joined(lo[r], hi[r]);
#endif
}
#endif

// y[r, 0..cols) (+ bias) for R rows of x against one panel.
template <int R, class X, class W>
inline void block(const X* x, int64_t k, const W* panel, const float* bias, float* y, int64_t n, int64_t cols) {
#if defined(KVCACHE_V16)
  v16 acc[R];
  accumulate16<R>(x, k, panel, acc);
  if (bias != nullptr) {
    float b[kPanel] = {};
    std::copy(bias, bias + cols, b);
    const v16 bv = load16(b);
    for (int r = 0; r < R; ++r) acc[r] += bv;
  }
  for (int r = 0; r < R; ++r) {
    if (cols == kPanel) {
      store16(y + r * n, acc[r]);
    } else {
      float tmp[kPanel];
      store16(tmp, acc[r]);
      std::copy(tmp, tmp + cols, y + r * n);
    }
  }
#else
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
#endif
}

// f(std::integral_constant<int, R>, r) for the blocks of R rows starting at r that cover
// [row_lo, row_hi): kRows at a time, then one block of the rest.
template <int R, class F>
inline void remainder_block(int64_t rest, int64_t r, F& f) {
  if constexpr (R > 0) {
    if (rest == R) {
      f(std::integral_constant<int, R>{}, r);
    } else {
      remainder_block<R - 1>(rest, r, f);
    }
  }
}

template <class F>
inline void for_row_blocks(int64_t row_lo, int64_t row_hi, F f) {
  int64_t r = row_lo;
  for (; r + kRows <= row_hi; r += kRows) f(std::integral_constant<int, kRows>{}, r);
  remainder_block<kRows - 1>(row_hi - r, r, f);
}

// Words of W in one row of a panel (k, or the pair i for a dot panel): 16 weights.
template <class W>
constexpr int64_t words_per_row() {
  return std::is_same_v<W, uint32_t> ? kPanel / 2 : kPanel;
}

// Rows [row_lo, row_hi) by panels [p_lo, p_hi): each panel (K x 16, in L1 for K <= 256)
// meets every row block of the range before the next panel is read.
template <class X, class W>
void rows_by_panels(const X* x, const W* packed, const float* bias, float* y, int64_t k, int64_t n,
                    int64_t row_lo, int64_t row_hi, int64_t p_lo, int64_t p_hi) {
  constexpr int64_t kWords = words_per_row<W>();  // per row of a panel
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
template <int R, class X, class W>
inline void swiglu_block(const X* x, int64_t k, const W* gate_panel, const W* up_panel, float* y, int64_t n) {
  float gate[R][kPanel];  // to L1: the up panel's accumulators need the registers
#if defined(KVCACHE_V16)
  v16 acc[R];
  accumulate16<R>(x, k, gate_panel, acc);
  for (int r = 0; r < R; ++r) store16(gate[r], acc[r]);
  accumulate16<R>(x, k, up_panel, acc);
  v8 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    float up[kPanel];
    store16(up, acc[r]);
    lo[r] = load(up);
    hi[r] = load(up + 8);
  }
#else
  v8 lo[R], hi[R];
  accumulate<R>(x, k, gate_panel, lo, hi);
  for (int r = 0; r < R; ++r) {
    store(gate[r], lo[r]);
    store(gate[r] + 8, hi[r]);
  }
  accumulate<R>(x, k, up_panel, lo, hi);
#endif
  const v8 one = splat(1.f);
  for (int r = 0; r < R; ++r) {
    const v8 g0 = load(gate[r]), g1 = load(gate[r] + 8);
    store(y + r * n, g0 / (one + exp_any(-g0)) * lo[r]);
    store(y + r * n + 8, g1 / (one + exp_any(-g1)) * hi[r]);
  }
}

// Rows [row_lo, row_hi) by output panels [p_lo, p_hi) of y (M, n), n = I a multiple of 16.
template <class X, class W>
void swiglu_rows_by_panels(const X* x, const W* packed, float* y, int64_t k, int64_t n, int64_t row_lo,
                           int64_t row_hi, int64_t p_lo, int64_t p_hi) {
  constexpr int64_t kWords = words_per_row<W>();
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
  const int64_t threads = kvcache_par::num_threads();
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
    kvcache_par::parallel_for(0, tasks, 1, run);
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

at::Tensor pack_linear_weight_bf16_dot(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "pack_linear_weight_bf16_dot takes a contiguous bfloat16 weight (N, K)");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel, k2 = (k + 1) / 2;
  at::Tensor packed = at::zeros({panels, k2, 2 * kPanel}, weight.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  for (int64_t c = 0; c < n; ++c)
    for (int64_t i = 0; i < k; ++i)
      out[(c / kPanel) * k2 * 2 * kPanel + (i / 2) * 2 * kPanel + 2 * (c % kPanel) + i % 2] = w[c * k + i];
  return packed;
}

// A packed product's inputs, checked for `op`: x contiguous float32 (M, K), packed from
// one of the three packings with K matching. Returns its weights: one of the three
// pointers, the others null.
struct PackedWeights {
  const float* f32;
  const uint32_t* bf16;
  const DotWord* dot;
};

PackedWeights check_product(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              " takes contiguous float32 x (M, K)");
  const auto type = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  ((type == at::kFloat && packed.size(2) == kPanel) || (type == at::kInt && packed.size(2) == kPanel / 2) ||
                   (type == at::kBFloat16 && packed.size(2) == 2 * kPanel)),
              op, " takes a weight from pack_linear_weight, pack_linear_weight_bf16 or pack_linear_weight_bf16_dot");
  if (type == at::kBFloat16) {
    TORCH_CHECK(packed.size(1) == (x.size(1) + 1) / 2, "x has ", x.size(1), " columns, the packed weight ",
                2 * packed.size(1) - 1, " or ", 2 * packed.size(1));
    return {nullptr, nullptr, reinterpret_cast<const DotWord*>(packed.data_ptr<at::BFloat16>())};
  }
  TORCH_CHECK(packed.size(1) == x.size(1), "x has ", x.size(1), " columns, the packed weight ", packed.size(1));
  if (type == at::kInt) return {nullptr, reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()), nullptr};
  return {packed.data_ptr<float>(), nullptr, nullptr};
}

// x (M, K) as bfloat16 pairs (M, ceil(K/2)) for a dot-packed weight (`round_rows`).
at::Tensor rounded_pairs(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor xw = at::empty({m, (k + 1) / 2}, x.options().dtype(at::kInt));
  const float* xp = x.data_ptr<float>();
  uint32_t* wp = reinterpret_cast<uint32_t*>(xw.data_ptr<int32_t>());
  if (m * k < 32768 || kvcache_par::in_parallel_region()) {
    round_rows(xp, wp, k, 0, m);
  } else {
    kvcache_par::parallel_for(0, m, 64, [&](int64_t lo, int64_t hi) { round_rows(xp, wp, k, lo, hi); });
  }
  return xw;
}

// f(xs, weights, k) with x as the packing reads it: float32 rows (K values) for the float32
// and bf16-stored packings, bfloat16 pairs (ceil(K/2) words, `rounded_pairs`) for the dot
// packing; weights typed for the packing. Every product op runs its kernel through this.
template <class F>
void with_operands(const at::Tensor& x, const PackedWeights& w, F f) {
  if (w.dot != nullptr) {
    const at::Tensor xw = rounded_pairs(x);
    f(reinterpret_cast<const uint32_t*>(xw.data_ptr<int32_t>()), w.dot, xw.size(1));
  } else if (w.bf16 != nullptr) {
    f(x.data_ptr<float>(), w.bf16, x.size(1));
  } else {
    f(x.data_ptr<float>(), w.f32, x.size(1));
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  const PackedWeights w = check_product("packed_linear", x, packed);
  const int64_t m = x.size(0), panels = packed.size(0);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n = ", n, " does not fit ", panels, " panels");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be contiguous float32 of shape (", n, ",)");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  with_operands(x, w, [&](const auto* xs, const auto* weights, int64_t k) {
    parallel_tasks(m, panels, [&](int64_t row_lo, int64_t row_hi, int64_t p_lo, int64_t p_hi) {
      rows_by_panels(xs, weights, bp, yp, k, n, row_lo, row_hi, p_lo, p_hi);
    });
  });
  return y;
}

at::Tensor packed_linear_swiglu(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const PackedWeights w = check_product("packed_linear_swiglu", x, packed);
  const int64_t m = x.size(0), panels = packed.size(0);
  TORCH_CHECK(n == panels * kPanel && n % (2 * kPanel) == 0, "packed_linear_swiglu needs the gate's and the up's ",
              "rows, each a multiple of ", kPanel, ", as the weight's n; got n = ", n, " for ", panels, " panels");
  const int64_t width = n / 2;
  at::Tensor y = at::empty({m, width}, x.options());
  if (m == 0) return y;
  float* yp = y.data_ptr<float>();
  with_operands(x, w, [&](const auto* xs, const auto* weights, int64_t k) {
    parallel_tasks(m, width / kPanel, [&](int64_t row_lo, int64_t row_hi, int64_t p_lo, int64_t p_hi) {
      swiglu_rows_by_panels(xs, weights, yp, k, width, row_lo, row_hi, p_lo, p_hi);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("pack_linear_weight_bf16(Tensor weight) -> Tensor");
  m.def("pack_linear_weight_bf16_dot(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("packed_linear_swiglu(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("pack_linear_weight_bf16", pack_linear_weight_bf16);
  m.impl("pack_linear_weight_bf16_dot", pack_linear_weight_bf16_dot);
  m.impl("packed_linear", packed_linear);
  m.impl("packed_linear_swiglu", packed_linear_swiglu);
}
