// Paged decode attention on CPU: one query token per item against keys read straight
// from the KV pool through a slot list (no gathered copy of K/V).
//
// Why: a decode step's K/V reads are memory-bound on CPU. Gathering each item's slots
// into a padded tensor for torch's flash kernel reads the context twice and writes it
// once; this kernel reads each key and value once, asking for the rows a block ahead
// (see kAhead). Scores are laid out key-major, 8 query heads to a vector, so the dot
// products of 8 heads are summed across lanes together and the softmax runs 8 heads at a
// time down the keys, with no horizontal sum per score. Measured with
// `python -m bench.attention_kernels` and `python -m bench --only peer` (BENCHMARKS.md).
// A bfloat16 pool is read as it lies, half the bytes of float32, each value widened to
// float32 as it is loaded (exact: a bfloat16 is the top half of a float32), and multiplies
// bfloat16 values as paged_flash does: the scaled query and the softmax weights are rounded
// to bfloat16 (`bf16_weight`: against the ceiling of each row max), so a score gets the same
// weight here, in paged_flash and in any split of the keys. Otherwise the float32 pool's
// arithmetic: where the rounding changes nothing the result is its bit for bit.
//
// kvcache::paged_decode(q, keys, values, key_slots, key_lens, scale) -> (out, lse)
//   q         (I, H, D)       float32, the query row of each item
//   keys      (S, Hkv, D)     float32 or bfloat16, one row per pool slot (a layer's key cache viewed flat)
//   values    (S, Hkv, D)     the same dtype as keys
//   key_slots (I, Lm)         int64, the pool slots item i reads, in order
//   key_lens  (I,)            int64, item i reads key_slots[i, :key_lens[i]] (>= 1)
//   out       (I, H, D)       float32, softmax(q k^T * scale) v per query head
//   lse       (I, H)          float32, log-sum-exp of the scaled scores (for the merge)
// Query head h reads K/V head h / (H / Hkv) (grouped-query attention).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace kvcache_vec;

// Keys ahead that a pass asks the memory system for (one block of the default size). The
// slots jump from block to block, and the hardware prefetcher only follows a new stream
// after a few misses: without these hints a pass waited on memory at about half the
// machine's streaming bandwidth (8 x 1,513 keys 1.06 -> 0.76 ms, 64 x 1,100 7.5 -> 5.4 ms;
// 8, 16 and 32 keys ahead measured alike, 64 worse).
constexpr int64_t kAhead = 16;

// Keys ahead that a pass asks for into L2 only (prefetcht2), on top of the kAhead hints:
// the L1 hints alone keep too few misses in flight to stream the pool from DRAM. On a
// 2-core Zen 4 (`python -m bench.attention_kernels`-shaped A/B, blocks scattered over a
// cold pool): 64 x 1,100 keys 4.1 -> 2.3 ms, 8 x 1,100 0.53-0.60 -> 0.28-0.40 ms,
// 64 x 97 0.33-0.38 -> 0.24-0.28 ms; 32, 48 and 96 keys ahead measured alike. The key
// pass's last kFar keys ask for the value pass's first rows.
constexpr int64_t kFar = 48;

// kFar for a pool of T (float, or uint16_t bfloat16 bits). A bfloat16 row is half the
// bytes, so its L2 hints go twice as many keys ahead, the same bytes in flight as float32's
// (64 x 1,100 keys, 2 threads, cold pool, A/B in one process: bfloat16 48 -> 96 keys ahead
// 1.53 -> 1.31-1.41 ms, 128 alike; kAhead 32 rather than 16 measured alike, so it stays).
template <class T>
constexpr int64_t kFarOf = kFar * int64_t(sizeof(float) / sizeof(T));

// Prefetch one pool row (row values of T, float or bfloat16 bits, one K/V head after
// another) into cache: one hint per 64-byte line.
template <class T>
inline void prefetch_row(const T* p, int64_t row) {
  constexpr int64_t line = 64 / int64_t(sizeof(T));
  for (int64_t b = 0; b < row; b += line) __builtin_prefetch(p + b, 0, 0);
}

// Prefetch one pool row into L2 (and L3), not L1.
template <class T>
inline void prefetch_row_far(const T* p, int64_t row) {
  constexpr int64_t line = 64 / int64_t(sizeof(T));
  for (int64_t b = 0; b < row; b += line) __builtin_prefetch(p + b, 0, 1);
}

// a * b + c, fused where the target has FMA: what GCC made of the scalar tails below on
// such targets (it contracts them; float32 results bit for bit unchanged at head sizes 1 to
// 49), written out so that their rounding cannot differ between the float32 and bfloat16
// instantiations (it did: GCC contracted one and not the other, 1 ulp apart at head size 20).
inline float mul_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// Sum of each of 8 vectors, as one vector: lane t = sum of p[t]'s lanes.
inline v8 transpose_sum(const v8* p) {
  // Adjacent-pair sums within 128-bit halves (the hadd pattern), three levels.
  auto hadd = [](v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8 t0 = hadd(p[0], p[1]), t1 = hadd(p[2], p[3]), t2 = hadd(p[4], p[5]), t3 = hadd(p[6], p[7]);
  const v8 u0 = hadd(t0, t1), u1 = hadd(t2, t3);
  // u0 = [p0..p3 low-half sums | p0..p3 high-half sums], u1 the same for p4..p7.
  return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Offsets of each query head's K/V head in a pool row, for heads [0, hp): lanes past
// the heads read the last head's (their scores are ignored). Why a table: `head / group`
// with a runtime group is an integer division per head per key, 8 of them a key in the
// score pass (perf: the key loop's hottest instructions waited on idiv).
inline void head_offsets(int64_t heads, int64_t hp, int64_t group, int64_t dim, int64_t* offsets) {
  for (int64_t h = 0; h < hp; ++h) offsets[h] = (std::min(h, heads - 1) / group) * dim;
}

// An item's scratch: scores sized (len, hp), hp the heads rounded up to whole 8-lane
// vectors (key-major: a vector holds 8 heads' scores of one key), and the query scaled
// by scale * log2 e (so scores come out in base 2), zero past the heads. Returns hp.
// ROUND (a bfloat16 pool): the scaled query rounded to bfloat16, as paged_flash rounds it.
template <bool ROUND>
inline int64_t prepare_item(const float* q, int64_t len, int64_t heads, int64_t dim, float scale,
                            std::vector<float>& scores, std::vector<float>& query) {
  const int64_t hp = (heads + 7) / 8 * 8;
  scores.resize(len * hp);
  query.assign(hp * dim, 0.f);
  const float qscale = scale * kLog2e;
  for (int64_t a = 0; a < heads * dim; ++a) query[a] = ROUND ? kv_float(round_bf16(q[a] * qscale)) : q[a] * qscale;
  return hp;
}

// Softmax weights in place over scores (len, hp), key-major, 8 heads per vector, each
// column's max given (maxes, hp): the sums of 2^(score - max) go to sums (hp each). ROUND
// (a bfloat16 pool): each max is raised to its ceiling first and the weights are
// `bf16_weight`'s, the ones paged_flash takes for the same scores.
template <bool ROUND>
inline void exp_columns(float* sc, int64_t len, int64_t hp, float* maxes, float* sums) {
  if constexpr (ROUND)
    for (int64_t h = 0; h < hp; ++h) maxes[h] = std::ceil(maxes[h]);
  for (int64_t h0 = 0; h0 < hp; h0 += 8) {
    const v8 mv = load(maxes + h0);
    v8 sv = {};
    for (int64_t j = 0; j < len; ++j) {
      const v8 e = ROUND ? bf16_weight(load(sc + j * hp + h0), mv) : exp2_neg(load(sc + j * hp + h0) - mv);
      store(sc + j * hp + h0, e);
      sv += e;
    }
    store(sums + h0, sv);
  }
}

// exp_columns after a pass for the maxes: each column's max goes to maxes (hp each).
template <bool ROUND>
inline void softmax_columns(float* sc, int64_t len, int64_t hp, float* maxes, float* sums) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h0 = 0; h0 < hp; h0 += 8) {
    v8 mv = splat(neg_inf);
    for (int64_t j = 0; j < len; ++j) {
      const v8 x = load(sc + j * hp + h0);
      mv = x > mv ? x : mv;
    }
    store(maxes + h0, mv);
  }
  exp_columns<ROUND>(sc, len, hp, maxes, sums);
}

// A bfloat16 pool (T = uint16_t) multiplies bfloat16 values: q and the weights rounded.
template <class T>
constexpr bool kRound = std::is_same_v<T, uint16_t>;

// One item: its query heads (H, D) against len keys, all K/V heads at once, so each
// slot's K row (Hkv * D floats, contiguous) and V row are read once and in order.
// Scores are kept key-major, (len, H rounded up to 8), in base 2 (the query is scaled by
// scale * log2 e): one vector holds 8 heads' scores of a key, so the softmax runs 8 heads
// at a time down the keys with a vectorised 2^x (a scalar exp per score cost as much as
// reading the keys). Sums run in a fixed order: float32 rounding, batch-independent.
// DIM > 0 is the head size known at compile time (unrolled, vectorised); 0: `dim`. T is the
// pool's storage (float, or uint16_t for bfloat16 bits), widened on load.
template <int DIM, class T>
void attend_item(const float* q, const T* kp, const T* vp, const int64_t* slots, int64_t len,
                 int64_t heads, int64_t kv_heads, int64_t dim_arg, float scale, float* out, float* lse,
                 std::vector<float>& scores, std::vector<float>& query, std::vector<float>& acc) {
  const int64_t dim = DIM > 0 ? DIM : dim_arg;
  const int64_t group = heads / kv_heads, row = kv_heads * dim;
  const int64_t hp = prepare_item<kRound<T>>(q, len, heads, dim, scale, scores, query);
  constexpr int64_t ahead = kAhead, far = kFarOf<T>;
  acc.assign(heads * dim, 0.f);
  std::vector<int64_t> offsets(hp);
  head_offsets(heads, hp, group, dim, offsets.data());
  float* __restrict sc = scores.data();
  const float* __restrict qs = query.data();
  // Pass 1: scores, keys read once; 8 heads' dot products summed across lanes together.
  for (int64_t j = 0; j < len; ++j) {
    const T* __restrict k = kp + slots[j] * row;
    if (j + ahead < len) prefetch_row(kp + slots[j + ahead] * row, row);
    // Written out here: the same test in a helper function lost the gain (measured).
    if (j + far < len)
      prefetch_row_far(kp + slots[j + far] * row, row);
    else if (j + far - len < len)
      prefetch_row_far(vp + slots[j + far - len] * row, row);
    for (int64_t h0 = 0; h0 < hp; h0 += 8) {
      v8 p[8];
      for (int t = 0; t < 8; ++t) {
        const T* __restrict kh = k + offsets[h0 + t];  // lanes past the heads: ignored
        const float* __restrict qh = qs + (h0 + t) * dim;
        v8 s = {};
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) s += load(qh + d) * load_kv(kh + d);
        float tail = 0.f;
        for (; d < dim; ++d) tail = mul_add(qh[d], kv_float(kh[d]), tail);
        s[0] += tail;
        p[t] = s;
      }
      store(sc + j * hp + h0, transpose_sum(p));
    }
  }
  std::vector<float> maxes(hp), sums(hp);
  softmax_columns<kRound<T>>(sc, len, hp, maxes.data(), sums.data());
  // Pass 2: weighted values, values read once.
  float* __restrict ac = acc.data();
  for (int64_t j = 0; j < std::min(ahead, len); ++j) prefetch_row(vp + slots[j] * row, row);
  for (int64_t j = 0; j < len; ++j) {
    const T* __restrict v = vp + slots[j] * row;
    if (j + ahead < len) prefetch_row(vp + slots[j + ahead] * row, row);
    if (j + far < len) prefetch_row_far(vp + slots[j + far] * row, row);
    const float* __restrict w = sc + j * hp;
    for (int64_t head = 0; head < heads; ++head) {
      const T* __restrict vh = v + offsets[head];
      float* __restrict ah = ac + head * dim;
      const v8 wv = splat(w[head]);
      int64_t d = 0;
      for (; d + 8 <= dim; d += 8) store(ah + d, load(ah + d) + wv * load_kv(vh + d));
      for (; d < dim; ++d) ah[d] = mul_add(w[head], kv_float(vh[d]), ah[d]);
    }
  }
  for (int64_t head = 0; head < heads; ++head) {
    const float inv = 1.f / sums[head];
    for (int64_t d = 0; d < dim; ++d) out[head * dim + d] = ac[head * dim + d] * inv;
    lse[head] = (maxes[head] + std::log2(sums[head])) * kLn2;
  }
}

#if defined(KVCACHE_V16)
// Sum of each of 8 16-lane vectors, as one 8-lane vector: lane t = sum of p[t]'s lanes.
inline v8 transpose_sum16(const v16* p) {
  // Each level halves the lanes per vector and doubles the vectors per register.
  v16 r[4];
  for (int k = 0; k < 4; ++k)
    r[k] = __builtin_shufflevector(p[2 * k], p[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * k], p[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 s[2];
  for (int k = 0; k < 2; ++k)
    s[k] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(r[2 * k], r[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const v16 t = __builtin_shufflevector(s[0], s[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(s[0], s[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(t, t, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(t, t, 1, 3, 5, 7, 9, 11, 13, 15);
}

// attend_item with 16-lane vectors (AVX-512), for head sizes 32, 64 and 128: the value
// pass keeps a chunk of heads' sums in registers (16 vectors) instead of loading and
// storing them for every key. On a 2-core Zen 4, one layer from cold caches, lengths
// drawn up to 97 and 1,100 keys: 64 rows 0.24 -> 0.16 ms, 8 rows 0.38 -> 0.33 ms.
// The score pass also keeps each column's max (no separate pass over the scores), and
// the value pass runs all kChunk heads without a test per head. With the head offsets
// table, one thread, 8 items x 672 keys scattered over a 64k-slot pool (best of 5 runs
// of 3,000): 180 -> 155 us; in the default model's decode step, 8 rows x (512 shared +
// 160) 114 -> 95 us a layer. Long contexts are bound by memory instead: 8 x (512 + 1,000)
// stays at ~340 us a layer, ~35 GB/s, what this VM's DRAM streams to two threads.
template <int DIM, class T>
void attend_item16(const float* q, const T* kp, const T* vp, const int64_t* slots, int64_t len,
                   int64_t heads, int64_t kv_heads, float scale, float* out, float* lse,
                   std::vector<float>& scores, std::vector<float>& query) {
  static_assert(DIM % 16 == 0, "16-lane path");
  constexpr int kVecs = DIM / 16;                 // vectors per head row
  constexpr int kChunk = kVecs >= 16 ? 1 : 16 / kVecs;  // heads whose sums fit 16 registers
  const int64_t group = heads / kv_heads, row = kv_heads * DIM;
  const int64_t hp = prepare_item<kRound<T>>(q, len, heads, DIM, scale, scores, query);
  constexpr int64_t ahead = kAhead, far = kFarOf<T>;
  int64_t offsets[512 + 8];
  head_offsets(heads, hp, group, DIM, offsets);
  float maxes[512 + 8], sums[512 + 8];  // the score pass keeps each column's max
  for (int64_t h = 0; h < hp; ++h) maxes[h] = -std::numeric_limits<float>::infinity();
  float* __restrict sc = scores.data();
  const float* __restrict qs = query.data();
  for (int64_t j = 0; j < len; ++j) {
    const T* __restrict k = kp + slots[j] * row;
    if (j + ahead < len) prefetch_row(kp + slots[j + ahead] * row, row);
    // Written out here: the same test in a helper function lost the gain (measured).
    if (j + far < len)
      prefetch_row_far(kp + slots[j + far] * row, row);
    else if (j + far - len < len)
      prefetch_row_far(vp + slots[j + far - len] * row, row);
    for (int64_t h0 = 0; h0 < hp; h0 += 8) {
      v16 p[8];
      for (int t = 0; t < 8; ++t) {
        const T* __restrict kh = k + offsets[h0 + t];
        const float* __restrict qh = qs + (h0 + t) * DIM;
        v16 s = load16(qh) * load16_kv(kh);
        for (int c = 1; c < kVecs; ++c) s += load16(qh + 16 * c) * load16_kv(kh + 16 * c);
        p[t] = s;
      }
      const v8 x = transpose_sum16(p), m = load(maxes + h0);
      store(sc + j * hp + h0, x);
      store(maxes + h0, x > m ? x : m);
    }
  }
  exp_columns<kRound<T>>(sc, len, hp, maxes, sums);
  for (int64_t h0 = 0; h0 < heads; h0 += kChunk) {
    const int64_t nh = std::min<int64_t>(kChunk, heads - h0);
    const int64_t lo = (h0 / group) * DIM, hi = ((h0 + nh - 1) / group + 1) * DIM;  // values of a row read
    v16 acc[kChunk][kVecs];
    for (int t = 0; t < kChunk; ++t)
      for (int c = 0; c < kVecs; ++c) acc[t][c] = v16{};
    for (int64_t j = 0; j < std::min(ahead, len); ++j) prefetch_row(vp + slots[j] * row + lo, hi - lo);
    for (int64_t j = 0; j < len; ++j) {
      const T* __restrict v = vp + slots[j] * row;
      if (j + ahead < len) prefetch_row(vp + slots[j + ahead] * row + lo, hi - lo);
      if (j + far < len) prefetch_row_far(vp + slots[j + far] * row + lo, hi - lo);
      const float* __restrict w = sc + j * hp + h0;
      for (int t = 0; t < kChunk; ++t) {  // all kChunk: sums past nh are dropped below
        const T* __restrict vh = v + offsets[h0 + t];
        const v16 wv = splat16(w[t]);
        for (int c = 0; c < kVecs; ++c) acc[t][c] += wv * load16_kv(vh + 16 * c);
      }
    }
    for (int t = 0; t < nh; ++t) {
      const float inv = 1.f / sums[h0 + t];
      for (int c = 0; c < kVecs; ++c) store16(out + (h0 + t) * DIM + 16 * c, acc[t][c] * inv);
      lse[h0 + t] = (maxes[h0 + t] + std::log2(sums[h0 + t])) * kLn2;
    }
  }
}
#endif

// Every item of a call, K/V stored as T (float, or uint16_t for bfloat16 bits).
template <class T>
void decode_items(const float* qp, const T* kp, const T* vp, const int64_t* slots, const int64_t* lens,
                  int64_t items, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim, float fscale,
                  float* op, float* lp) {
  // One task per item. Inputs are checked by the caller: nothing may throw in the parallel region.
  kvcache_par::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query, acc;
    for (int64_t i = begin; i < end; ++i) {
      const float* qi = qp + i * heads * dim;
      float* oi = op + i * heads * dim;
      float* li = lp + i * heads;
      const int64_t* si = slots + i * width;
#if defined(KVCACHE_V16)
      if (heads <= 512 && (dim == 32 || dim == 64 || dim == 128)) {
        if (dim == 32)
          attend_item16<32>(qi, kp, vp, si, lens[i], heads, kv_heads, fscale, oi, li, scores, query);
        else if (dim == 64)
          attend_item16<64>(qi, kp, vp, si, lens[i], heads, kv_heads, fscale, oi, li, scores, query);
        else
          attend_item16<128>(qi, kp, vp, si, lens[i], heads, kv_heads, fscale, oi, li, scores, query);
        continue;
      }
#endif
      switch (dim) {
        case 32:
          attend_item<32>(qi, kp, vp, si, lens[i], heads, kv_heads, dim, fscale, oi, li, scores, query, acc);
          break;
        case 64:
          attend_item<64>(qi, kp, vp, si, lens[i], heads, kv_heads, dim, fscale, oi, li, scores, query, acc);
          break;
        case 128:
          attend_item<128>(qi, kp, vp, si, lens[i], heads, kv_heads, dim, fscale, oi, li, scores, query, acc);
          break;
        default:
          attend_item<0>(qi, kp, vp, si, lens[i], heads, kv_heads, dim, fscale, oi, li, scores, query, acc);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_decode(
    const at::Tensor& q,
    const at::Tensor& keys,
    const at::Tensor& values,
    const at::Tensor& key_slots,
    const at::Tensor& key_lens,
    double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode takes q (I, H, D), float32, contiguous");
  const int64_t items = q.size(0), heads = q.size(1), dim = q.size(2);
  check_paged_inputs("paged_decode", keys, values, key_slots, key_lens, items);
  const int64_t kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(2) == dim, "K/V shapes disagree with q");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "query heads must be a multiple of K/V heads");
  const int64_t width = key_slots.size(1);

  at::Tensor out = at::empty({items, heads, dim}, q.options());
  at::Tensor lse = at::empty({items, heads}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = key_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  if (keys.scalar_type() == at::kFloat) {
    decode_items(qp, keys.data_ptr<float>(), values.data_ptr<float>(), slots, lens, items, width, heads, kv_heads,
                 dim, fscale, op, lp);
  } else {  // bfloat16 (checked above)
    decode_items(qp, reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), slots, lens, items, width,
                 heads, kv_heads, dim, fscale, op, lp);
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(kvcache, m) {
  m.def("paged_decode(Tensor q, Tensor keys, Tensor values, Tensor key_slots, Tensor key_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("paged_decode", paged_decode);
}
