// Shared by the native CPU kernels: 8-lane float vectors (GCC/Clang vector extensions,
// so one source builds for AVX2, AVX-512 and NEON with `-march=native`), vectorised
// exponentials (2^x for softmax weights, e^x), loads that widen a bfloat16 K/V pool to
// float32, and the checks of a paged kernel's K/V inputs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvcache_vec {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads and stores
typedef int v8i __attribute__((vector_size(32)));
typedef unsigned v8u32 __attribute__((vector_size(32)));

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

// 16-lane vectors where the machine has AVX-512 (one register each): kernels with a
// 16-lane path guard it with KVCACHE_V16.
#if defined(__AVX512F__)
#define KVCACHE_V16 1
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 splat16(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#endif

// K/V pool values as float32, whatever the pool stores: float32 as is, or bfloat16 (kept
// as its bits, uint16_t), the top 16 bits of a float32, so widening is exact: the bits
// shifted up 16. The paged kernels load K/V only through these, templated on the storage
// type: a float32 pool's loads stay the plain loads they were, and a bfloat16 one reads half
// the bytes (decode attention is memory-bound) for the same float32 arithmetic.
inline float kv_float(float x) { return x; }
inline float kv_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
// Written with intrinsics where the machine has them: GCC 12 lowers __builtin_convertvector
// of 16 uint16 lanes to two 8-lane zero-extends and a 256-bit insert, which made the
// bfloat16 decode kernel's score pass ~50% slower than float32's with the data in cache.
inline v8 load_kv(const float* p) { return load(p); }
inline v8 load_kv(const uint16_t* p) {
#if defined(__AVX2__)
  return (v8)((v8u32)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))) << 16);
#else
  typedef unsigned short v8bf __attribute__((vector_size(16), aligned(2)));
  const v8u32 u = __builtin_convertvector(*reinterpret_cast<const v8bf*>(p), v8u32) << 16;
  v8 f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}
#if defined(KVCACHE_V16)
inline v16 load16_kv(const float* p) { return load16(p); }
inline v16 load16_kv(const uint16_t* p) {
  // The zero-masking form: the plain one trips GCC 12's -Wmaybe-uninitialized in its header
  // (an all-ones mask compiles to the same unmasked vpmovzxwd).
  typedef unsigned v16u32 __attribute__((vector_size(64)));
  const __m512i x = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (v16)((v16u32)x << 16);
}
#endif

// The bits of floats (uint32_t, or a vector of them) rounded to bfloat16, in the high half
// (the low half zero): round_bf16's rounding, for any number but NaN. A macro, not a
// template: GCC 12 deduces a vector typedef that depends on a template parameter (bf16_weight's)
// as its element type.
#define KVCACHE_BF16_ROUNDED_BITS(u) (((u) + 0x7FFFu + (((u) >> 16) & 1u)) & 0xFFFF0000u)

// A float rounded to bfloat16 bits as torch's float32 -> bfloat16 conversion on x86 rounds
// it (the vectorised path `.to(torch.bfloat16)` takes): to nearest, ties to even, by adding
// 0x7FFF plus the kept half's lowest bit and dropping the low half (a carry out of the
// mantissa goes into the exponent: inf where it should), and a NaN becomes 0xFFFF (the sum
// could carry a NaN's payload into inf, or wrap it to 0). Integer arithmetic rather than
// AVX512_BF16's vcvtneps2bf16, which flushes denormals to zero where torch keeps them.
inline uint16_t round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return x != x ? uint16_t(0xFFFF) : uint16_t(KVCACHE_BF16_ROUNDED_BITS(u) >> 16);
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// e^(f ln 2) for f in [-0.5, 0.5]: the degree-6 series (relative error about 1e-7).
template <class V>
inline V exp2_poly(V f) {
  V p = f * 1.5403530393381606e-4f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  return p * f + 1.f;
}

// 2^t per lane for t in [-126, 126] (callers clamp): exp2_poly of t's fraction, scaled by
// 2^round(t).
inline v8 exp2_core(v8 t) {
  const v8 big = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  v8 n = (t + big) - big;
  v8 p = exp2_poly(t - n);
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 2^x per lane for x <= 0 (scores minus their row max); x < -126.5 gives 0, as do -inf
// and NaN. exp2_core's value (but for x an exact half-integer, rounded to the other
// neighbouring n: the same 2^x within float rounding), in 11 vector ops where clamping
// and masking took 17 (the softmax's weights are a fifth of the flash kernel's
// work at head size 32): x is raised to -127 (NaN too), 1.5 * 2^23 + 127 added rounds it
// to n + 127 in the low bits of the sum, which shifted up by 23 are the bits of 2^n (0,
// the float 0, for n = -127).
template <class V>
inline V exp2_neg(V x) {
  typedef unsigned U __attribute__((vector_size(sizeof(V))));
  const V lowest = V{} - 127.f;
  x = x > lowest ? x : lowest;
  const V biased = V{} + 12583039.f;  // 1.5 * 2^23 + 127
  const V sum = x + biased;
  const V p = exp2_poly(x - (sum - biased));  // of x - n, in [-0.5, 0.5]
  U bits;
  std::memcpy(&bits, &sum, sizeof(bits));
  bits <<= 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The softmax weights of a bfloat16 pool's attention: 2^(x - m) per lane rounded to bfloat16
// (kept as float32), for an integer m >= every x of the row (the kernels take the ceiling of
// the row max). Computed as 2^f * 2^(n - m), n = round(x), f = x - n (both exact), so the
// rounded fraction part depends on x alone and the weight against another integer max m' is
// this one times 2^(m - m') exactly: the weights of one score are the same bfloat16 value
// (scaled) in every kernel and every split of the keys (a chunk after a cached prefix,
// merged by log-sum-exp, or one pass), and rescaling a running sum by a power of two is
// exact. x - m below -126.5 gives 0, as do -inf and NaN.
template <class V>
inline V bf16_weight(V x, V m) {
  typedef unsigned U __attribute__((vector_size(sizeof(V))));
  const V lowest = m - 127.f;
  x = x > lowest ? x : lowest;  // NaN too
  const V big = V{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x + big) - big;
  const V biased = V{} + 12583039.f;  // 1.5 * 2^23 + 127: n - m + 127 in the low bits of the sum
  const V sum = (n - m) + biased;
  U bits;
  std::memcpy(&bits, &sum, sizeof(bits));
  bits <<= 23;  // 2^(n - m), 0 for n - m = -127
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  V p = exp2_poly(x - n);
  std::memcpy(&bits, &p, sizeof(bits));
  bits = KVCACHE_BF16_ROUNDED_BITS(bits);
  std::memcpy(&p, &bits, sizeof(p));
  return p * scale;
}
// e^x per lane for any finite x, the exponent clamped to [-126, 126] in base 2 (so about
// 1e-38 below x = -87 and 1e38 above 87: finite, where e^x would under- or overflow).
inline v8 exp_any(v8 x) {
  v8 t = x * splat(kLog2e);
  t = t < splat(-126.f) ? splat(-126.f) : t;
  t = t > splat(126.f) ? splat(126.f) : t;
  return exp2_core(t);
}

// A paged kernel's K/V inputs: contiguous keys/values (S, Hkv, D) shaped alike, both float32
// or both bfloat16, int64 contiguous key_slots (I, Lm) and key_lens (I,), every item reading
// 1..Lm keys of slots inside the pool. `name` is the op, for the messages.
inline void check_paged_inputs(const char* name, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& key_slots, const at::Tensor& key_lens, int64_t items) {
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes(), name, ": keys and values must be (S, Hkv, D) alike");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              name, ": keys and values must share a dtype, float32 or bfloat16 (got ", keys.scalar_type(), " and ",
              values.scalar_type(), ")");
  TORCH_CHECK(key_slots.scalar_type() == at::kLong && key_lens.scalar_type() == at::kLong,
              "key_slots and key_lens must be int64");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && key_slots.is_contiguous() && key_lens.is_contiguous(),
              name, " takes contiguous tensors");
  TORCH_CHECK(key_slots.dim() == 2 && key_slots.size(0) == items && key_lens.dim() == 1 && key_lens.size(0) == items,
              "key_slots (I, Lm) and key_lens (I,) must match q's I");
  const int64_t width = key_slots.size(1), num_slots = keys.size(0);
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = key_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < items; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width, "key_lens[", i, "] = ", lens[i], " outside 1..", width);
    for (int64_t j = 0; j < lens[i]; ++j) {
      const int64_t slot = slots[i * width + j];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the pool of ", num_slots);
    }
  }
}

}  // namespace kvcache_vec
