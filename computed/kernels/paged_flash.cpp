// Paged flash attention on CPU for tiles of several query rows per item (prefill chunks,
// cascade segments), keys read straight from the KV pool through a slot list.
//
// Why: torch's fused CPU flash kernel reaches about a third of this machine's float32
// peak at head size 32 (its per-block GEMM calls are short and its causal blocking wastes
// work), and it needs the item's keys gathered into a dense, head-repeated copy first.
// This kernel keeps a block of query rows (the query heads of one K/V head folded in, so
// K/V are read once per group) against a block of keys in registers: scores by
// broadcast-FMA against a transposed key block, an online softmax in base 2, then
// weighted values. Measured with `python -m bench.attention_kernels` (flash block).
// A bfloat16 pool multiplies bfloat16 values: the scaled q and each block's softmax weights
// are rounded to bfloat16 (the weights against the ceiling of the running max,
// `bf16_weight`: the same weight for a score whatever the block, the split of the keys, or
// the kernel, paged_decode included). Where AVX512_BF16 is, the products run as vdpbf16ps
// on pair words the gather lays out (gather_dot), twice the products an instruction; elsewhere
// as float32 FMAs on the rounded values, the same bits. `python -m bench.attention_kernels`,
// flash block, 2 threads, float32 pool -> bfloat16 pool: 4,032 prefill rows x 1,024 shared
// keys 24.9 -> 18.1 ms, 64 decode rows x 1,024 0.44 -> 0.36, 4 causal prompts of 1,088
// 16.4 -> 12.3. Where the rounding changes nothing the result is the float32 pool's bit for bit.
//
// kvcache::paged_flash(q, keys, values, key_slots, key_lens, causal, scale) -> (out, lse)
//   q         (I, Qm, H, D)   float32, the query rows of each item
//   keys      (S, Hkv, D)     float32 or bfloat16, one row per pool slot (a layer's key cache viewed flat)
//   values    (S, Hkv, D)     the same dtype as keys
//   key_slots (I, Lm)         int64, the pool slots item i reads, in order
//   key_lens  (I,)            int64, item i reads key_slots[i, :key_lens[i]] (>= 1)
//   causal    bool            query row r sees keys 0..r only (top-left aligned, as torch's)
//   out       (I, Qm, H, D)   float32, softmax(q k^T * scale) v per query head
//   lse       (I, Qm, H)      float32, natural log-sum-exp of the scaled scores
// Query head h reads K/V head h / (H / Hkv). Rows past an item's real queries get finite
// values (every row sees key 0); callers drop them. A NaN score gets weight 0 here (the
// vector max and 2^x skip it) where torch's kernel would propagate it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

// The dot tiles (bfloat16 products by AVX512_BF16's vdpbf16ps) for a bfloat16 pool, and their
// gather (AVX512_BW's 16-bit permutes; every CPU with AVX512_BF16 has them).
#if defined(KVCACHE_V16) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVCACHE_FLASH_DOT 1
#endif

namespace {

using namespace kvcache_vec;

// The largest of `init` and s[0..n), n a multiple of 8 (NaN lanes are skipped).
inline float max_of(const float* s, int64_t n, float init) {
  v8 mv = splat(init);
  for (int64_t j = 0; j < n; j += 8) {
    const v8 x = load(s + j);
    mv = x > mv ? x : mv;
  }
  float mx = mv[0];
  for (int lane = 1; lane < 8; ++lane) mx = mv[lane] > mx ? mv[lane] : mx;
  return mx;
}

// Softmax weights in base 2, in place: s[j] = 2^(s[j] - mx) for j < n (a multiple of 8;
// -inf scores get 0), where ROUND rounded to bfloat16 as `bf16_weight` (mx an integer).
// Returns their sum (of the weights as stored), added in a fixed order.
template <bool ROUND>
inline float exp2_weights(float* s, int64_t n, float mx) {
  v8 sum = {};
  const v8 mxv = splat(mx);
  for (int64_t j = 0; j < n; j += 8) {
    const v8 e = ROUND ? bf16_weight(load(s + j), mxv) : exp2_neg(load(s + j) - mxv);
    store(s + j, e);
    sum += e;
  }
  return ((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7]));
}

// Keys per block (a multiple of the 32-key score tile). Each block costs every row a max, a
// rescale of its output and a few scalar steps: 128 keys rather than 64 made the kernel 7%
// faster (A/B of the two builds, 2 threads, on the tiles `python -m bench.attention_kernels`'
// flash block times: 64 decode rows x 1,024 shared keys 1.62 -> 1.45 ms, 2,048 rows 45.8 ->
// 42.5 ms); at 256 the scores no longer sit in L1 and it slowed.
constexpr int kBlockKeys = 128;
// Query rows per unit (positions x group): a multiple of the 3-row register tile, so no
// row of a unit is padding where the group divides it (33 positions of 2 heads; 64 rows
// padded to 66 cost 3%: A/B of the two builds on the same tiles).
constexpr int kBlockRows = 66;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys ahead whose K/V rows the gather asks for: a row is a few cache lines of a block
// anywhere in the pool, and without the hints the copy waits on memory a row at a time.
// 64 decode rows x 1,024 keys in random blocks, caches evicted first, 2 threads: 957 ->
// 615-665 us a call (16 ahead: 703; 64: no better); in the shared-prefix decode step
// (`torch.profiler`, 64 x (1,024 + 97)) 670 -> 568 us a layer.
constexpr int64_t kGatherAhead = 32;

struct Shape {
  int64_t queries, heads, kv_heads, dim, width, group;
};

// Ask for key j + kGatherAhead's K/V rows of head h (T: float, or uint16_t bfloat16 bits),
// one hint per 64-byte line, where that key is one of the item's.
template <class T>
inline void prefetch_ahead(const T* kp, const T* vp, const int64_t* slots, int64_t j, int64_t len, const Shape& sh,
                           int64_t h) {
  if (j + kGatherAhead >= len) return;
  const int64_t ahead = (slots[j + kGatherAhead] * sh.kv_heads + h) * sh.dim;
  constexpr int64_t line = 64 / int64_t(sizeof(T));
  for (int64_t d = 0; d < sh.dim; d += line) {
    __builtin_prefetch(kp + ahead + d, 0, 0);
    __builtin_prefetch(vp + ahead + d, 0, 0);
  }
}

// One job's K/V out of the pool (stored as T: float, or uint16_t for bfloat16 bits, widened
// here) into float32 scratch: the keys of item i's slots (len of them) for K/V head h,
// transposed by key block into kt, (lp_keys / kBlockKeys, D, kBlockKeys), and their values
// into vc, (lp_keys, D); zero past len.
template <class T>
inline void gather(const T* kp, const T* vp, const int64_t* slots, int64_t len, int64_t lp_keys, const Shape& sh,
                   int64_t h, float* kt, float* vc) {
  for (int64_t j = 0; j < lp_keys; ++j) {
    float* tile = kt + (j / kBlockKeys) * kBlockKeys * sh.dim + j % kBlockKeys;
    prefetch_ahead(kp, vp, slots, j, len, sh, h);
    if (j < len) {
      const int64_t row = (slots[j] * sh.kv_heads + h) * sh.dim;
      for (int64_t d = 0; d < sh.dim; ++d) tile[d * kBlockKeys] = kv_float(kp[row + d]);
      if constexpr (sizeof(T) == sizeof(float)) {
        std::memcpy(vc + j * sh.dim, vp + row, sh.dim * sizeof(float));
      } else {
        for (int64_t d = 0; d < sh.dim; ++d) vc[j * sh.dim + d] = kv_float(vp[row + d]);
      }
    } else {
      for (int64_t d = 0; d < sh.dim; ++d) tile[d * kBlockKeys] = 0.f;
      std::fill(vc + j * sh.dim, vc + (j + 1) * sh.dim, 0.f);
    }
  }
}

// The head sizes the register-transposing gathers (gather8, gather16, gather_dot) take.
constexpr int64_t kMaxGatherDim = 256;

// The K rows of keys j0 .. j0 + N - 1 of a job (`zeros` past len) into krow, and their V rows
// into vc as float32 (zeros past len), with gather's look-ahead hints: the register-transposing
// gathers' shared part (T: float, or uint16_t bfloat16 bits, widened; head size a multiple of 8).
template <int N, class T>
inline void key_rows(const T* kp, const T* vp, const int64_t* slots, int64_t j0, int64_t len, const Shape& sh,
                     int64_t h, const T* zeros, const T* krow[N], float* vc) {
  for (int r = 0; r < N; ++r) {
    const int64_t j = j0 + r;
    prefetch_ahead(kp, vp, slots, j, len, sh, h);
    if (j < len) {
      const int64_t row = (slots[j] * sh.kv_heads + h) * sh.dim;
      krow[r] = kp + row;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(vc + j * sh.dim, vp + row, sh.dim * sizeof(float));
      } else {
        for (int64_t d = 0; d < sh.dim; d += 8) store(vc + j * sh.dim + d, load_kv(vp + row + d));
      }
    } else {
      krow[r] = zeros;
      std::fill(vc + j * sh.dim, vc + (j + 1) * sh.dim, 0.f);
    }
  }
}

#if defined(__AVX2__)
// 8 rows of 8 floats transposed in registers: r[c] becomes column c of the block.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // per lane: column k of rows 4i .. 4i + 3 in u[4i + k]
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {  // low lanes: columns 0-3, high lanes: columns 4-7
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// gather's job 8 keys at a time (T: float, or uint16_t bfloat16 bits widened as it loads),
// head size a multiple of 8 (at most kMaxGatherDim): their K rows transposed by 8 x 8
// blocks in registers, one store per head dimension where gather stores each key's values
// one by one. The same bytes in the same places as gather. Why: a cascade segment of a few
// decode rows is mostly its copy. One call of 4 items x 16 rows x 1,024 keys in scattered
// slots on a 2-core Zen 3 (AVX2), 10th percentile of 300 calls, 3 interleaved pairs of
// builds: bfloat16 pool 605-682 -> 439-554 us, float32 665-693 -> 588-737 (2 of 3 faster).
template <class T>
inline void gather8(const T* kp, const T* vp, const int64_t* slots, int64_t len, int64_t lp_keys, const Shape& sh,
                    int64_t h, float* kt, float* vc) {
  alignas(64) static const T kZeros[kMaxGatherDim] = {};
  for (int64_t j0 = 0; j0 < lp_keys; j0 += 8) {  // 8 keys inside one key block (kBlockKeys % 8 == 0)
    float* tile = kt + (j0 / kBlockKeys) * kBlockKeys * sh.dim + j0 % kBlockKeys;
    const T* krow[8];
    key_rows<8>(kp, vp, slots, j0, len, sh, h, kZeros, krow, vc);
    for (int64_t d0 = 0; d0 < sh.dim; d0 += 8) {
      __m256 x[8];
      for (int r = 0; r < 8; ++r) x[r] = (__m256)load_kv(krow[r] + d0);
      transpose8(x);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(tile + (d0 + c) * kBlockKeys, x[c]);
    }
  }
}
#endif

#if defined(KVCACHE_V16)
// 16 rows of 16 floats transposed in registers: r[c] becomes column c of the block.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane L of r[4i + k]: column 4L + k of rows 4i .. 4i + 3
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {  // t[k]: lanes 0, 2 of r[k], r[4 + k]; t[4 + k]: lanes 1, 3 (rows 8-15 in 8 ..)
    t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {  // column c = 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
    r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xdd);
  }
}

// gather's job from a float32 pool, head size a multiple of 16 (at most kMaxGatherDim): 16
// keys at a time, their K rows transposed by 16 x 16 blocks in registers, one store per
// head dimension, where gather stores each key's values one by one (16 strided stores for
// one here). The same bytes in the same places as gather. Why: gather was ~12% of a warm
// prefill's forward (64 new tokens over 4,096 cached, default model, 1 thread: py-spy
// --native, the job loop's own samples), ~0.1 ms of each (item, K/V head) job's ~1 ms.
inline void gather16(const float* kp, const float* vp, const int64_t* slots, int64_t len, int64_t lp_keys,
                     const Shape& sh, int64_t h, float* kt, float* vc) {
  alignas(64) static const float kZeros[kMaxGatherDim] = {};
  for (int64_t j0 = 0; j0 < lp_keys; j0 += 16) {  // 16 keys inside one key block (kBlockKeys % 16 == 0)
    float* tile = kt + (j0 / kBlockKeys) * kBlockKeys * sh.dim + j0 % kBlockKeys;
    const float* krow[16];
    key_rows<16>(kp, vp, slots, j0, len, sh, h, kZeros, krow, vc);
    for (int64_t d0 = 0; d0 < sh.dim; d0 += 16) {
      __m512 x[16];
      for (int r = 0; r < 16; ++r) x[r] = _mm512_loadu_ps(krow[r] + d0);
      transpose16(x);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(tile + (d0 + c) * kBlockKeys, x[c]);
    }
  }
}
#endif

#if defined(KVCACHE_FLASH_DOT)
// gather's job for the dot tiles, from a bfloat16 pool, head size a multiple of 32: the keys
// as pair words by key block, (lp_keys / kBlockKeys, D / 2, kBlockKeys), word (p, j) =
// k_j[2p] high | k_j[2p + 1] low; the values as (lp_keys / 2, D) words, word (i, d) = v_2i[d]
// high | v_2i+1[d] low; zero past len. 16 keys at a time: each key's K row loaded as 16-bit
// pairs, its halves swapped into pair words (one rotate), the 16 rows transposed by 16 x 16
// words in registers and stored one vector a pair index; each pair of keys' V rows
// interleaved by 16-bit permutes, two vectors per 32 dims. It replaced a copy of each key's
// 16-bit halves one by one, which at few query rows a unit was most of a job. One layer's
// tile of 4 items x 8 decode rows x 1,024 shared keys, a bfloat16 pool, 2 threads: 248 ->
// 137 us (4 x 4 rows: 218 -> 103, 1 x 32: 120 -> 92); it is what lets decode rows cascade
// from 3 members (`python -m bench.attention_kernels`' cascade block,
// computed.attention's `WIDE_GATHER_CASCADE`).
inline void gather_dot(const uint16_t* kp, const uint16_t* vp, const int64_t* slots, int64_t len,
                       int64_t lp_keys, const Shape& sh, int64_t h, uint32_t* ktw, uint32_t* vw) {
  alignas(64) static const uint16_t kZeros[kMaxGatherDim] = {};
  // Word d of a V pair vector: low half the odd key's value d, high half the even key's.
  alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                     53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                     27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  const int64_t half = sh.dim / 2;
  for (int64_t j0 = 0; j0 < lp_keys; j0 += 16) {  // 16 keys inside one key block (kBlockKeys % 16 == 0)
    uint32_t* tile = ktw + (j0 / kBlockKeys) * kBlockKeys * half + j0 % kBlockKeys;
    const uint16_t* krow[16];
    const uint16_t* vrow[16];
    for (int r = 0; r < 16; ++r) {
      const int64_t j = j0 + r;
      prefetch_ahead(kp, vp, slots, j, len, sh, h);
      const int64_t row = j < len ? (slots[j] * sh.kv_heads + h) * sh.dim : -1;
      krow[r] = row >= 0 ? kp + row : kZeros;
      vrow[r] = row >= 0 ? vp + row : kZeros;
    }
    for (int64_t d0 = 0; d0 < sh.dim; d0 += 32) {
      __m512 x[16];
      // A 32-bit load holds k[2p] low, k[2p + 1] high: the rotate puts k[2p] high.
      for (int r = 0; r < 16; ++r) x[r] = _mm512_castsi512_ps(_mm512_rol_epi32(_mm512_loadu_si512(krow[r] + d0), 16));
      transpose16(x);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(reinterpret_cast<float*>(tile + (d0 / 2 + c) * kBlockKeys), x[c]);
      for (int pair = 0; pair < 8; ++pair) {
        const __m512i even = _mm512_loadu_si512(vrow[2 * pair] + d0), odd = _mm512_loadu_si512(vrow[2 * pair + 1] + d0);
        uint32_t* dst = vw + (j0 / 2 + pair) * sh.dim + d0;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(odd, low, even));
        _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(odd, high, even));
      }
    }
  }
}
#endif

// Scratch of one thread, reused across units.
struct Scratch {
  std::vector<float> q, s, o, m, l;
  std::vector<uint32_t> qw, pw;  // bfloat16 pair words of q and of the weights (the dot tiles)
  void reserve(int64_t dim) {
    const int64_t rows = kBlockRows + 12;  // rounded up to whole row tiles
    q.resize(rows * dim);
    qw.resize(rows * dim / 2);
    pw.resize(rows * kBlockKeys / 2);
    s.resize(rows * kBlockKeys);
    o.resize(rows * dim);
    m.resize(rows);
    l.resize(rows);
  }
};

// Register tiles: kRowTile query rows at once, so each key (or value) vector loaded feeds
// kRowTile FMAs into 12 independent accumulators (enough to hide the FMA latency).
constexpr int kRowTile = 3;

// s[r, c..c+32) = q[r, :] . kt[:, c..c+32) for the kRowTile rows from q (row stride dim).
template <int DIM>
inline void scores_tile(const float* q, const float* kt, float* s, int64_t dim_arg) {
  const int64_t dim = DIM > 0 ? DIM : dim_arg;
  v8 acc[kRowTile][4] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const float* k = kt + d * kBlockKeys;
    const v8 k0 = load(k), k1 = load(k + 8), k2 = load(k + 16), k3 = load(k + 24);
    for (int r = 0; r < kRowTile; ++r) {
      const v8 b = splat(q[r * dim + d]);
      acc[r][0] += b * k0;
      acc[r][1] += b * k1;
      acc[r][2] += b * k2;
      acc[r][3] += b * k3;
    }
  }
  for (int r = 0; r < kRowTile; ++r)
    for (int c = 0; c < 4; ++c) store(s + r * kBlockKeys + 8 * c, acc[r][c]);
}

// o[r, :] += sum_j p[r, j] v_j[:] for the kRowTile rows from o (row stride dim); vrows
// (keys, dim) contiguous; dim a multiple of 8.
template <int DIM>
inline void values_tile(const float* p, const float* vrows, int64_t keys, float* o, int64_t dim_arg) {
  const int64_t dim = DIM > 0 ? DIM : dim_arg;
  for (int64_t d0 = 0; d0 < dim; d0 += 32) {
    if (dim - d0 >= 32) {
      v8 acc[kRowTile][4];
      for (int r = 0; r < kRowTile; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = load(o + r * dim + d0 + 8 * c);
      for (int64_t j = 0; j < keys; ++j) {
        const float* v = vrows + j * dim + d0;
        const v8 v0 = load(v), v1 = load(v + 8), v2 = load(v + 16), v3 = load(v + 24);
        for (int r = 0; r < kRowTile; ++r) {
          const v8 w = splat(p[r * kBlockKeys + j]);
          acc[r][0] += w * v0;
          acc[r][1] += w * v1;
          acc[r][2] += w * v2;
          acc[r][3] += w * v3;
        }
      }
      for (int r = 0; r < kRowTile; ++r)
        for (int c = 0; c < 4; ++c) store(o + r * dim + d0 + 8 * c, acc[r][c]);
    } else {
      for (int64_t d = d0; d < dim; d += 8) {
        v8 acc[kRowTile];
        for (int r = 0; r < kRowTile; ++r) acc[r] = load(o + r * dim + d);
        for (int64_t j = 0; j < keys; ++j) {
          const v8 v = load(vrows + j * dim + d);
          for (int r = 0; r < kRowTile; ++r) acc[r] += splat(p[r * kBlockKeys + j]) * v;
        }
        for (int r = 0; r < kRowTile; ++r) store(o + r * dim + d, acc[r]);
      }
    }
  }
}

// 8-lane tiles for a known head size, shaped for 16 vector registers (AVX2): 6 rows x 16
// keys for scores and 6 rows x 16 dims for values, 12 accumulators + 2 key (value) vectors
// + 1 broadcast. The 3 x 32 tiles above need 17, so GCC folds each key load into every row's
// FMA (15 loads for 12 FMAs, the loads' port the bound). Same chains in the same order as
// theirs: the same bits. 2-core Zen 3 (AVX2), one layer of 4 causal 1,040-token prompts at the
// built-in model's shape (8 heads over 4 K/V heads of 32), 3 interleaved pairs of builds,
// medians of 15 calls: float32 pool 27.2-28.4 -> 21.3-23.6 ms (~80 -> ~100 GFLOP/s, of ~197
// FMA peak), bfloat16 pool 32.5-34.7 -> 23.2-23.6 ms.
constexpr int kRowTile8 = 6;

template <int DIM>
inline void scores_tile8(const float* q, const float* kt, float* s) {
  v8 acc[kRowTile8][2] = {};
  for (int64_t d = 0; d < DIM; ++d) {
    v8 k0 = load(kt + d * kBlockKeys), k1 = load(kt + d * kBlockKeys + 8);
    asm("" : "+x"(k0), "+x"(k1));  // in registers: loaded once for the 6 rows
    for (int r = 0; r < kRowTile8; ++r) {
      const v8 b = splat(q[r * DIM + d]);
      acc[r][0] += b * k0;
      acc[r][1] += b * k1;
    }
  }
  for (int r = 0; r < kRowTile8; ++r) {
    store(s + r * kBlockKeys, acc[r][0]);
    store(s + r * kBlockKeys + 8, acc[r][1]);
  }
}

template <int DIM>
inline void values_tile8(const float* p, const float* vrows, int64_t keys, float* o) {
  static_assert(DIM % 16 == 0, "values_tile8 takes head sizes that are a multiple of 16");
  for (int d0 = 0; d0 < DIM; d0 += 16) {
    v8 acc[kRowTile8][2];
    for (int r = 0; r < kRowTile8; ++r) {
      acc[r][0] = load(o + r * DIM + d0);
      acc[r][1] = load(o + r * DIM + d0 + 8);
    }
    for (int64_t j = 0; j < keys; ++j) {
      v8 v0 = load(vrows + j * DIM + d0), v1 = load(vrows + j * DIM + d0 + 8);
      asm("" : "+x"(v0), "+x"(v1));
      for (int r = 0; r < kRowTile8; ++r) {
        const v8 w = splat(p[r * kBlockKeys + j]);
        acc[r][0] += w * v0;
        acc[r][1] += w * v1;
      }
    }
    for (int r = 0; r < kRowTile8; ++r) {
      store(o + r * DIM + d0, acc[r][0]);
      store(o + r * DIM + d0 + 8, acc[r][1]);
    }
  }
}

#if defined(KVCACHE_V16)
// 16-lane versions (AVX-512), for head sizes that are a multiple of 16: a score tile is
// 3 rows x 64 keys and a value tile 6 rows (head size 32) or 3 rows x 64 dims, 12
// accumulators each, so each vector loaded feeds twice the lanes of FMA work. On a
// 2-core Zen 4 (AVX-512 double-pumped), against the 8-lane path, 2 threads, the tiles of
// `python -m bench.attention_kernels`' flash block: 4,032 prefill rows x 1,024 shared keys
// 37.4 -> 25.5 ms, 64 decode rows x 1,024 0.64 -> 0.45 ms, a causal 1,088-token prompt
// 6.1 -> 4.2 ms.
constexpr int kWideKeys = 64;

inline float max_of16(const float* s, int64_t n, float init) {
  v16 mv = splat16(init);
  for (int64_t j = 0; j < n; j += 16) {
    const v16 x = load16(s + j);
    mv = x > mv ? x : mv;
  }
  const v8 h = __builtin_shufflevector(mv, mv, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 g = __builtin_shufflevector(mv, mv, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 m8 = h > g ? h : g;
  float mx = m8[0];
  for (int lane = 1; lane < 8; ++lane) mx = m8[lane] > mx ? m8[lane] : mx;
  return mx;
}

template <bool ROUND>
inline float exp2_weights16(float* s, int64_t n, float mx) {
  v16 sum = {};
  const v16 mxv = splat16(mx);
  for (int64_t j = 0; j < n; j += 16) {
    const v16 e = ROUND ? bf16_weight(load16(s + j), mxv) : exp2_neg(load16(s + j) - mxv);
    store16(s + j, e);
    sum += e;
  }
  const v8 h = __builtin_shufflevector(sum, sum, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(sum, sum, 8, 9, 10, 11, 12, 13, 14, 15);
  return ((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7]));
}

template <int DIM>
inline void scores_tile16(const float* q, const float* kt, float* s) {
  v16 acc[kRowTile][4] = {};
  for (int64_t d = 0; d < DIM; ++d) {
    const float* k = kt + d * kBlockKeys;
    v16 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
    // In registers: GCC otherwise folds each load into every row's FMA (three loads of a
    // key vector instead of one), and the tile ran at load-port speed (32.7 -> 25.5 ms on
    // the 4,032 x 1,024 tile above).
    asm("" : "+v"(k0), "+v"(k1), "+v"(k2), "+v"(k3));
    for (int r = 0; r < kRowTile; ++r) {
      const v16 b = splat16(q[r * DIM + d]);
      acc[r][0] += b * k0;
      acc[r][1] += b * k1;
      acc[r][2] += b * k2;
      acc[r][3] += b * k3;
    }
  }
  for (int r = 0; r < kRowTile; ++r)
    for (int c = 0; c < 4; ++c) store16(s + r * kBlockKeys + 16 * c, acc[r][c]);
}

// Rows per value tile: 12 accumulators of 16 lanes.
template <int DIM>
constexpr int wide_value_rows() { return DIM == 16 ? 12 : DIM == 32 ? 6 : 3; }

template <int DIM>
inline void values_tile16(const float* p, const float* vrows, int64_t keys, float* o) {
  constexpr int kRows = wide_value_rows<DIM>();
  constexpr int kVecs = DIM >= 64 ? 4 : DIM / 16;  // vectors per row per pass
  for (int d0 = 0; d0 < DIM; d0 += 16 * kVecs) {
    v16 acc[kRows][kVecs];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = load16(o + r * DIM + d0 + 16 * c);
    for (int64_t j = 0; j < keys; ++j) {
      const float* v = vrows + j * DIM + d0;
      v16 vv[kVecs];
      for (int c = 0; c < kVecs; ++c) vv[c] = load16(v + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const v16 w = splat16(p[r * kBlockKeys + j]);
        for (int c = 0; c < kVecs; ++c) acc[r][c] += w * vv[c];
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVecs; ++c) store16(o + r * DIM + d0 + 16 * c, acc[r][c]);
  }
}

#if defined(KVCACHE_FLASH_DOT)
// The tiles of a bfloat16 pool in bfloat16 products: vdpbf16ps multiplies the two bfloat16
// halves of each 32-bit lane and adds both to the float32 lane (32 products an instruction
// where an FMA does 16, at the same rate). Words hold two neighbours along the sum (dims for
// scores, keys for values) with the earlier one in the HIGH half, because the instruction adds
// the high half's product first: each lane's chain then runs over d (or j) in order from
// zero, one rounded add per exact product, which is the float32 tiles' FMA chain on the same
// rounded inputs. This path and the portable one (ROUND without DOT) give the same bits.
// Measured in the header (float32 pool -> bfloat16 pool).

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// Two floats that are bfloat16 values as one pair word, `first` in the high half.
inline uint32_t pair_word(float first, float second) {
  return (float_bits(first) & 0xFFFF0000u) | (float_bits(second) >> 16);
}

inline __m512bh bf16_words(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// s[r, c..c+64) for kRowTile rows of q words (DIM / 2 a row) against 64 keys of a key block
// of words (DIM / 2, kBlockKeys).
template <int DIM>
inline void scores_tile_dot(const uint32_t* qw, const uint32_t* ktw, float* s) {
  __m512 acc[kRowTile][4];
  for (int r = 0; r < kRowTile; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < DIM / 2; ++p) {
    const uint32_t* k = ktw + p * kBlockKeys;
    __m512i k0 = _mm512_loadu_si512(k), k1 = _mm512_loadu_si512(k + 16), k2 = _mm512_loadu_si512(k + 32),
            k3 = _mm512_loadu_si512(k + 48);
    // In registers, as scores_tile16's: GCC otherwise loads each key vector once per row.
    asm("" : "+v"(k0), "+v"(k1), "+v"(k2), "+v"(k3));
    for (int r = 0; r < kRowTile; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * (DIM / 2) + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, (__m512bh)k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, (__m512bh)k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, (__m512bh)k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, (__m512bh)k3);
    }
  }
  for (int r = 0; r < kRowTile; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kBlockKeys + 16 * c, acc[r][c]);
}

// o[r, :] += sum_j p[r, j] v_j for the tile's rows, over `pairs` pairs of keys: weights as
// pair words (kBlockKeys / 2 a row), values as words (pairs, DIM).
template <int DIM>
inline void values_tile_dot(const uint32_t* pw, const uint32_t* vw, int64_t pairs, float* o) {
  constexpr int kRows = wide_value_rows<DIM>();
  constexpr int kVecs = DIM >= 64 ? 4 : DIM / 16;
  for (int d0 = 0; d0 < DIM; d0 += 16 * kVecs) {
    __m512 acc[kRows][kVecs];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_loadu_ps(o + r * DIM + d0 + 16 * c);
    for (int64_t j = 0; j < pairs; ++j) {
      __m512bh vv[kVecs];
      for (int c = 0; c < kVecs; ++c) vv[c] = bf16_words(vw + j * DIM + d0 + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r * (kBlockKeys / 2) + j]));
        for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, vv[c]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(o + r * DIM + d0 + 16 * c, acc[r][c]);
  }
}

// A row's weights (bfloat16 values kept as floats, n a multiple of 32) as pair words: word i
// = bits(s[2i]) high half | bits(s[2i + 1]) high half, one 16-bit permute per 32 weights.
inline void pack_weights(const float* s, uint32_t* pw, int64_t n) {
  // Result half 2i takes s[2i + 1]'s high half (16-bit element 4i + 3 of the two vectors),
  // half 2i + 1 takes s[2i]'s (element 4i + 1).
  alignas(64) static constexpr uint16_t kPick[32] = {3,  1,  7,  5,  11, 9,  15, 13, 19, 17, 23,
                                                     21, 27, 25, 31, 29, 35, 33, 39, 37, 43, 41,
                                                     47, 45, 51, 49, 55, 53, 59, 57, 63, 61};
  const __m512i pick = _mm512_load_si512(kPick);
  for (int64_t j = 0; j < n; j += 32) {
    const __m512i a = _mm512_loadu_si512(s + j), b = _mm512_loadu_si512(s + j + 16);
    _mm512_storeu_si512(pw + j / 2, _mm512_permutex2var_epi16(a, pick, b));
  }
}
#endif
#endif

inline float max_of16_or8(const float* s, int64_t n, float init) {
#if defined(KVCACHE_V16)
  return max_of16(s, n, init);
#else
  return max_of(s, n, init);
#endif
}

template <bool ROUND>
inline float exp2_weights16_or8(float* s, int64_t n, float mx) {
#if defined(KVCACHE_V16)
  return exp2_weights16<ROUND>(s, n, mx);
#else
  return exp2_weights<ROUND>(s, n, mx);
#endif
}

// One unit: item i, K/V head kvh, query positions [q0, q0 + positions). ROUND (a bfloat16
// pool): the scaled q and the softmax weights are rounded to bfloat16, so every product is
// of two bfloat16 values; DOT: those products by the dot tiles, kt and vc then holding
// gather_dot's words.
template <int DIM, bool ROUND, bool DOT>
void attend_unit(const float* qp, const float* kt, const float* vc, int64_t len,
                 bool causal, float scale, const Shape& sh, int64_t i, int64_t kvh, int64_t q0,
                 int64_t positions, float* op, float* lp, Scratch& w) {
  const int64_t dim = DIM > 0 ? DIM : sh.dim, g = sh.group;
#if defined(KVCACHE_V16)
  constexpr bool kWide = DIM > 0 && DIM % 16 == 0;
  constexpr int64_t kRowUnit = kWide ? wide_value_rows<(kWide ? DIM : 16)>() : kRowTile;
  constexpr int64_t kKeyUnit = kWide ? kWideKeys : 32;
#else
  constexpr bool kWide = false;
  constexpr int64_t kRowUnit = DIM > 0 && DIM % 16 == 0 ? kRowTile8 : kRowTile, kKeyUnit = 32;
#endif
  // The 8-lane tiles for 16 registers (scores_tile8, values_tile8): a known head size
  // without the 16-lane ones.
  constexpr bool kNarrow = !kWide && DIM > 0 && DIM % 16 == 0;
  static_assert(!kNarrow || kRowUnit == kRowTile8, "rows come in whole narrow tiles");
  const int64_t rows = positions * g, padded_rows = (rows + kRowUnit - 1) / kRowUnit * kRowUnit;
  float* __restrict q = w.q.data();
  float* __restrict o = w.o.data();
  float* __restrict m = w.m.data();
  float* __restrict l = w.l.data();
  // Rows: r = position * g + (head within the group); scores in base 2.
  const float qscale = scale * kLog2e;
  for (int64_t r = 0; r < padded_rows; ++r) {
    float* dst = q + r * dim;
    if (r < rows) {
      const float* src = qp + ((i * sh.queries + q0 + r / g) * sh.heads + kvh * g + r % g) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        if constexpr (ROUND)
          dst[d] = kv_float(round_bf16(src[d] * qscale));
        else
          dst[d] = src[d] * qscale;
      }
    } else {
      std::fill(dst, dst + dim, 0.f);
    }
  }
#if defined(KVCACHE_FLASH_DOT)
  if constexpr (DOT)
    for (int64_t r = 0; r < padded_rows; ++r)
      for (int64_t p = 0; p < dim / 2; ++p) w.qw[r * dim / 2 + p] = pair_word(q[r * dim + 2 * p], q[r * dim + 2 * p + 1]);
#endif
  std::fill(o, o + padded_rows * dim, 0.f);
  std::fill(m, m + padded_rows, kNegInf);
  std::fill(l, l + padded_rows, 0.f);
  // Keys this unit can see: causal rows stop at their own position.
  const int64_t end_keys = causal ? std::min(len, q0 + positions) : len;
  for (int64_t k0 = 0; k0 < end_keys; k0 += kBlockKeys) {
    const int64_t nk = std::min<int64_t>(kBlockKeys, end_keys - k0);
    const int64_t nk_padded = (nk + kKeyUnit - 1) / kKeyUnit * kKeyUnit;  // whole score tiles (zero keys past nk, masked)
    float* __restrict s = w.s.data();
#if defined(KVCACHE_FLASH_DOT)
    if constexpr (DOT) {
      static_assert(kWide, "the dot tiles are the wide tiles' shapes");
      const uint32_t* ktw = reinterpret_cast<const uint32_t*>(kt) + k0 * dim / 2;
      for (int64_t r = 0; r < padded_rows; r += kRowTile)
        for (int64_t c = 0; c < nk_padded; c += kWideKeys)
          scores_tile_dot<DIM>(w.qw.data() + r * dim / 2, ktw + c, s + r * kBlockKeys + c);
    } else
#endif
#if defined(KVCACHE_V16)
    if constexpr (kWide) {
      for (int64_t r = 0; r < padded_rows; r += kRowTile)
        for (int64_t c = 0; c < nk_padded; c += kWideKeys)
          scores_tile16<DIM>(q + r * dim, kt + k0 * dim + c, s + r * kBlockKeys + c);
    } else
#endif
    if constexpr (kNarrow) {
      for (int64_t r = 0; r < padded_rows; r += kRowTile8)
        for (int64_t c = 0; c < nk_padded; c += 16)
          scores_tile8<(kNarrow ? DIM : 16)>(q + r * dim, kt + k0 * dim + c, s + r * kBlockKeys + c);
    } else
    for (int64_t r = 0; r < padded_rows; r += kRowTile)
      for (int64_t c = 0; c < nk_padded; c += 32)
        scores_tile<DIM>(q + r * dim, kt + k0 * dim + c, s + r * kBlockKeys + c, dim);
    // Mask, online softmax.
    const bool diagonal = causal && k0 + nk - 1 > q0;
    for (int64_t r = 0; r < padded_rows; ++r) {
      float* sr = s + r * kBlockKeys;
      int64_t visible = nk;
      if (diagonal) visible = std::max<int64_t>(0, std::min<int64_t>(nk, q0 + r / g - k0 + 1));
      if (r >= rows) visible = std::min<int64_t>(nk, 1);
      for (int64_t j = visible; j < nk_padded; ++j) sr[j] = kNegInf;
      // Row max over the block, 8 lanes at a time (a scalar max chain costs ~4 cycles a key).
      float mx = kWide ? max_of16_or8(sr, nk_padded, m[r]) : max_of(sr, nk_padded, m[r]);
      if constexpr (ROUND) mx = std::ceil(mx);  // an integer max: see bf16_weight
      if (mx == kNegInf) {  // nothing visible yet in this row
        for (int64_t j = 0; j < nk_padded; ++j) sr[j] = 0.f;
        continue;
      }
      // 2^0 is 1 exactly: no call where the block leaves the max where it was (most blocks).
      const float correction = m[r] == kNegInf ? 0.f : mx == m[r] ? 1.f : std::exp2(m[r] - mx);
      m[r] = mx;
      const float total =
          kWide ? exp2_weights16_or8<ROUND>(sr, nk_padded, mx) : exp2_weights<ROUND>(sr, nk_padded, mx);
      l[r] = l[r] * correction + total;
      if (correction != 1.f) {
        float* orow = o + r * dim;
        const v8 cv = splat(correction);
        for (int64_t d = 0; d < dim; d += 8) store(orow + d, load(orow + d) * cv);
      }
    }
#if defined(KVCACHE_FLASH_DOT)
    if constexpr (DOT) {
      // Keys in pairs: a block's odd last key pairs with a masked one (weight 0).
      for (int64_t r = 0; r < padded_rows; ++r) pack_weights(s + r * kBlockKeys, w.pw.data() + r * kBlockKeys / 2, nk_padded);
      const uint32_t* vw = reinterpret_cast<const uint32_t*>(vc) + k0 / 2 * dim;
      for (int64_t r = 0; r < padded_rows; r += kRowUnit)
        values_tile_dot<DIM>(w.pw.data() + r * kBlockKeys / 2, vw, (nk + 1) / 2, o + r * dim);
    } else
#endif
#if defined(KVCACHE_V16)
    if constexpr (kWide) {
      for (int64_t r = 0; r < padded_rows; r += kRowUnit)
        values_tile16<DIM>(s + r * kBlockKeys, vc + k0 * dim, nk, o + r * dim);
    } else
#endif
    if constexpr (kNarrow) {
      for (int64_t r = 0; r < padded_rows; r += kRowTile8)
        values_tile8<(kNarrow ? DIM : 16)>(s + r * kBlockKeys, vc + k0 * dim, nk, o + r * dim);
    } else
    for (int64_t r = 0; r < padded_rows; r += kRowTile)
      values_tile<DIM>(s + r * kBlockKeys, vc + k0 * dim, nk, o + r * dim, dim);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = (i * sh.queries + q0 + r / g) * sh.heads + kvh * g + r % g;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < dim; ++d) op[row * dim + d] = o[r * dim + d] * inv;
    lp[row] = (m[r] + std::log2(l[r])) * kLn2;
  }
}

std::tuple<at::Tensor, at::Tensor> paged_flash(const at::Tensor& q, const at::Tensor& keys,
                                               const at::Tensor& values, const at::Tensor& key_slots,
                                               const at::Tensor& key_lens, bool causal, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_flash takes q (I, Qm, H, D), float32, contiguous");
  const int64_t items = q.size(0);
  check_paged_inputs("paged_flash", keys, values, key_slots, key_lens, items);
  Shape sh{q.size(1), q.size(2), keys.size(1), q.size(3), key_slots.size(1), 0};
  TORCH_CHECK(keys.size(2) == sh.dim, "K/V shapes disagree with q");
  TORCH_CHECK(sh.dim % 8 == 0, "paged_flash needs a head size that is a multiple of 8, got ", sh.dim);
  TORCH_CHECK(sh.kv_heads >= 1 && sh.heads % sh.kv_heads == 0, "query heads must be a multiple of K/V heads");
  sh.group = sh.heads / sh.kv_heads;
  TORCH_CHECK(sh.group <= kBlockRows, "at most ", kBlockRows, " query heads per K/V head");
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = key_lens.data_ptr<int64_t>();
  at::Tensor out = at::empty({items, sh.queries, sh.heads, sh.dim}, q.options());
  at::Tensor lse = at::empty({items, sh.queries, sh.heads}, q.options());
  const float* qp = q.data_ptr<float>();
  const bool bf16 = keys.scalar_type() == at::kBFloat16;  // else float32 (checked above)
  const float* kp = bf16 ? nullptr : keys.data_ptr<float>();
  const float* vp = bf16 ? nullptr : values.data_ptr<float>();
  const uint16_t* kb = bf16 ? reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()) : nullptr;
  const uint16_t* vb = bf16 ? reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()) : nullptr;
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Causal items' padding rows past the last block of real positions are zero, lse -inf
  // (rows inside it get finite values); callers drop every padding row. Only those rows are
  // filled: a whole-output fill was 4% of a 4 x 1,040-token prefill (`torch.profiler`,
  // aten::fill_), and items of one length have none.
  const int64_t per_block = std::max<int64_t>(1, kBlockRows / sh.group);
  if (causal) {
    for (int64_t i = 0; i < items; ++i) {
      const int64_t rows = std::min(lens[i], sh.queries);
      const int64_t computed = std::min(sh.queries, (rows + per_block - 1) / per_block * per_block);
      const int64_t first = (i * sh.queries + computed) * sh.heads, count = (sh.queries - computed) * sh.heads;
      std::fill(op + first * sh.dim, op + (first + count) * sh.dim, 0.f);
      std::fill(lp + first, lp + first + count, kNegInf);
    }
  }
  // A job is one (item, K/V head): its thread copies the keys, transposed by key block,
  // (Lp / kBlockKeys, D, kBlockKeys) with Lp a multiple of the key block (zero past the
  // item's keys; one tile is 16 KB at D = 32, read contiguously), and the values, (Lp, D),
  // out of the pool once into its own float32 scratch (gather), then runs every block of
  // query positions against them. Costliest jobs first, handed out one at a time so threads
  // finish together.
  const int64_t lp_keys = (sh.width + kBlockKeys - 1) / kBlockKeys * kBlockKeys;
  struct Job {
    int64_t item, kv_head, cost;
  };
  std::vector<Job> jobs;
  jobs.reserve(items * sh.kv_heads);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t rows = causal ? std::min(lens[i], sh.queries) : sh.queries;  // past: padding only
    const int64_t cost = causal ? rows * lens[i] / 2 + 1 : rows * lens[i];
    for (int64_t h = 0; h < sh.kv_heads; ++h) jobs.push_back({i, h, cost});
  }
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_jobs = static_cast<int64_t>(jobs.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(kvcache_par::num_threads(), num_jobs));
  // Inputs are checked above: nothing may throw in the parallel region.
  kvcache_par::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    scratch.reserve(sh.dim);
    // Uninitialised: every job's gather writes all of its part (zeros past the keys), and
    // zeroing 2 x 512 KB a call (4,096 keys at D = 32) showed in the profile above.
    std::unique_ptr<float[]> kt_buf(new float[sh.dim * lp_keys]), vc_buf(new float[sh.dim * lp_keys]);
    float* const kt_data = kt_buf.get();
    float* const vc_data = vc_buf.get();
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t x = next.fetch_add(1); x < num_jobs; x = next.fetch_add(1)) {
        const int64_t i = jobs[x].item, h = jobs[x].kv_head, len = lens[i];
        const int64_t rows = causal ? std::min(len, sh.queries) : sh.queries;
        // Every block of query positions of the job against its gathered K/V.
        auto attend = [&](auto unit) {
          for (int64_t q0 = 0; q0 < rows; q0 += per_block) {
            const int64_t positions = std::min(per_block, sh.queries - q0);
            unit(qp, kt_data, vc_data, len, causal, fscale, sh, i, h, q0, positions, op, lp, scratch);
          }
        };
        auto by_dim = [&](auto round) {
          constexpr bool R = decltype(round)::value;
          switch (sh.dim) {
            case 32: return attend(attend_unit<32, R, false>);
            case 64: return attend(attend_unit<64, R, false>);
            case 128: return attend(attend_unit<128, R, false>);
            default: return attend(attend_unit<0, R, false>);
          }
        };
        if (!bf16) {
#if defined(KVCACHE_V16)
          if (sh.dim % 16 == 0 && sh.dim <= kMaxGatherDim)
            gather16(kp, vp, slots + i * sh.width, len, lp_keys, sh, h, kt_data, vc_data);
          else
#endif
#if defined(__AVX2__)
          if (sh.dim % 8 == 0 && sh.dim <= kMaxGatherDim)
            gather8(kp, vp, slots + i * sh.width, len, lp_keys, sh, h, kt_data, vc_data);
          else
#endif
            gather(kp, vp, slots + i * sh.width, len, lp_keys, sh, h, kt_data, vc_data);
          by_dim(std::false_type{});
          continue;
        }
#if defined(KVCACHE_FLASH_DOT)
        if (sh.dim == 32 || sh.dim == 64 || sh.dim == 128) {
          gather_dot(kb, vb, slots + i * sh.width, len, lp_keys, sh, h, reinterpret_cast<uint32_t*>(kt_data),
                     reinterpret_cast<uint32_t*>(vc_data));
          switch (sh.dim) {
            case 32: attend(attend_unit<32, true, true>); break;
            case 64: attend(attend_unit<64, true, true>); break;
            default: attend(attend_unit<128, true, true>);
          }
          continue;
        }
#endif
#if defined(__AVX2__)
        if (sh.dim % 8 == 0 && sh.dim <= kMaxGatherDim)
          gather8(kb, vb, slots + i * sh.width, len, lp_keys, sh, h, kt_data, vc_data);
        else
#endif
          gather(kb, vb, slots + i * sh.width, len, lp_keys, sh, h, kt_data, vc_data);
        by_dim(std::true_type{});
      }
    }
  });
  return {out, lse};
}

// How many keys at a time paged_flash copies a job's K/V out of the pool for this head size
// and pool dtype in this build: 16 (gather16, gather_dot), 8 (gather8) or 1 (gather). A
// cascade segment of few decode rows pays off only where the copy is wide
// (computed.attention's `decode_cascade`).
int64_t flash_gather_keys(int64_t head_dim, bool bfloat16_pool) {
#if defined(KVCACHE_FLASH_DOT)
  if (bfloat16_pool && (head_dim == 32 || head_dim == 64 || head_dim == 128)) return 16;
#endif
#if defined(KVCACHE_V16)
  if (!bfloat16_pool && head_dim % 16 == 0 && head_dim <= kMaxGatherDim) return 16;
#endif
#if defined(__AVX2__)
  if (head_dim % 8 == 0 && head_dim <= kMaxGatherDim) return 8;
#endif
  return 1;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def(
      "paged_flash(Tensor q, Tensor keys, Tensor values, Tensor key_slots, Tensor key_lens, bool causal, "
      "float scale) -> (Tensor, Tensor)");
  // No tensor argument to dispatch on: one kernel for every key.
  m.def("flash_gather_keys(int head_dim, bool bfloat16_pool) -> int", flash_gather_keys);
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("paged_flash", paged_flash);
}
