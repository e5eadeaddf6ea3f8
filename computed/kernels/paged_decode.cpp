// Paged decode attention on CPU: one query token per item against keys read straight
// from the KV pool through a slot list (no gathered copy of K/V).
//
// Why: a decode step's K/V reads are memory-bound on CPU. Gathering each item's slots
// into a padded tensor for torch's flash kernel reads the context twice and writes it
// once; this kernel reads each key and value once. The softmax runs 8 keys at a time in
// base 2 (a scalar exp per score cost 10-15% of the call: 64 items x 1,100 keys 7.9 ->
// 6.9 ms, 8 x 1,513 1.14 -> 0.96 ms, hot). Measured with
// `python -m bench.attention_kernels` and `python -m bench --only peer` (BENCHMARKS.md).
//
// kvcache::paged_decode(q, keys, values, key_slots, key_lens, scale) -> (out, lse)
//   q         (I, H, D)       float32, the query row of each item
//   keys      (S, Hkv, D)     float32, one row per pool slot (a layer's key cache viewed flat)
//   values    (S, Hkv, D)     float32
//   key_slots (I, Lm)         int64, the pool slots item i reads, in order
//   key_lens  (I,)            int64, item i reads key_slots[i, :key_lens[i]] (>= 1)
//   out       (I, H, D)       float32, softmax(q k^T * scale) v per query head
//   lse       (I, H)          float32, log-sum-exp of the scaled scores (for the merge)
// Query head h reads K/V head h / (H / Hkv) (grouped-query attention).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using namespace kvcache_vec;

// One item: its query heads (H, D) against len keys, all K/V heads at once, so each
// slot's K row (Hkv * D floats, contiguous) and V row are read once and in order.
// Scores are kept per head, (H, len padded to 8), in base 2 (the query is scaled by
// scale * log2 e): the softmax then runs 8 keys at a time, a vectorised 2^x instead of a
// scalar exp per score (which cost as much as reading the keys).
// DIM > 0 is the head size known at compile time (unrolled, vectorised); 0: `dim`.
template <int DIM>
void attend_item(const float* q, const float* kp, const float* vp, const int64_t* slots, int64_t len,
                 int64_t heads, int64_t kv_heads, int64_t dim_arg, float scale, float* out, float* lse,
                 std::vector<float>& scores, std::vector<float>& query, std::vector<float>& acc) {
  const int64_t dim = DIM > 0 ? DIM : dim_arg;
  const int64_t group = heads / kv_heads, row = kv_heads * dim;
  const int64_t padded = (len + 7) / 8 * 8;
  scores.resize(heads * padded);  // (H, padded)
  query.resize(heads * dim);
  acc.assign(heads * dim, 0.f);
  const float qscale = scale * kLog2e;
  for (int64_t a = 0; a < heads * dim; ++a) query[a] = q[a] * qscale;
  float* __restrict sc = scores.data();
  const float* __restrict qs = query.data();
  // Pass 1: scores, keys read once.
  for (int64_t j = 0; j < len; ++j) {
    const float* __restrict k = kp + slots[j] * row;
    for (int64_t head = 0; head < heads; ++head) {
      const float* __restrict kh = k + (head / group) * dim;
      const float* __restrict qh = qs + head * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qh[d] * kh[d];
      sc[head * padded + j] = s;
    }
  }
  // Softmax weights, per head, 8 keys at a time (padding lanes get weight 0).
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> maxes(heads), sums(heads);
  for (int64_t head = 0; head < heads; ++head) {
    float* __restrict sh = sc + head * padded;
    for (int64_t j = len; j < padded; ++j) sh[j] = neg_inf;
    maxes[head] = max_of(sh, padded, neg_inf);
    sums[head] = exp2_weights(sh, padded, maxes[head]);
  }
  // Pass 2: weighted values, values read once.
  float* __restrict ac = acc.data();
  for (int64_t j = 0; j < len; ++j) {
    const float* __restrict v = vp + slots[j] * row;
    for (int64_t head = 0; head < heads; ++head) {
      const float w = sc[head * padded + j];
      const float* __restrict vh = v + (head / group) * dim;
      float* __restrict ah = ac + head * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ah[d] += w * vh[d];
    }
  }
  for (int64_t head = 0; head < heads; ++head) {
    const float inv = 1.f / sums[head];
    for (int64_t d = 0; d < dim; ++d) out[head * dim + d] = ac[head * dim + d] * inv;
    lse[head] = (maxes[head] + std::log2(sums[head])) * kLn2;
  }
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
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = key_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One task per item. Inputs are checked above: nothing may throw in the parallel region.
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query, acc;
    for (int64_t i = begin; i < end; ++i) {
      const float* qi = qp + i * heads * dim;
      float* oi = op + i * heads * dim;
      float* li = lp + i * heads;
      const int64_t* si = slots + i * width;
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
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(kvcache, m) {
  m.def("paged_decode(Tensor q, Tensor keys, Tensor values, Tensor key_slots, Tensor key_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("paged_decode", paged_decode);
}
