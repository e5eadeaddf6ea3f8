// A step's new K/V rows into their pool slots on CPU: one call for keys and values, a row
// copy per token, reading k and v where they lie in the fused q/k/v product.
//
// Why: two `index_copy_` calls a layer cost 15 us each for 8 rows and 48 us for 64 (their
// TensorIterator set-up, and a copy of the strided v first): 0.4 ms of a 21 ms decode
// step of 64 rows, 0.1 ms here (torch profiler over the default model's decode steps,
// shaped as `python -m bench.attention_kernels`' decode steps block runs them).
//
// kvcache::write_kv(keys, values, k, v, slots) -> ()
//   keys, values (S, Hkv, D) contiguous, both float32 or both bfloat16: a layer's pool viewed
//                one row per slot (written; a bfloat16 pool gets k.to(torch.bfloat16) and
//                v's, rounded to nearest even as torch rounds)
//   k, v         (T, Hkv, D) float32, each row's Hkv * D values contiguous (rows may be strided)
//   slots        (T,) int64: row t goes to slot slots[t], every slot inside the pool and
//                none twice (the batch's plan checks that; a repeat would keep the last)

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "parallel.h"
#include "vec.h"

#include <cstdint>
#include <cstring>

namespace {

using namespace kvcache_vec;

// n floats rounded as round_bf16 rounds them, 8 at a time.
inline void round_row_bf16(const float* src, uint16_t* dst, int64_t n) {
  typedef unsigned short v8h __attribute__((vector_size(16), aligned(2)));
  int64_t a = 0;
  for (; a + 8 <= n; a += 8) {
    const v8 x = load(src + a);
    v8u32 u;
    std::memcpy(&u, &x, sizeof(u));
    u = KVCACHE_BF16_ROUNDED_BITS(u) >> 16;
    u = x == x ? u : 0xFFFFu;
    *reinterpret_cast<v8h*>(dst + a) = __builtin_convertvector(u, v8h);
  }
  for (; a < n; ++a) dst[a] = round_bf16(src[a]);
}

void write_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous(),
              "write_kv: keys and values must be contiguous (S, Hkv, D) alike");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "write_kv: keys and values must share a dtype, float32 or bfloat16 (got ", keys.scalar_type(), " and ",
              values.scalar_type(), ")");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == keys.size(1) && k.size(2) == keys.size(2) &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "write_kv: k and v must be float32 (T, Hkv, D) shaped like the pool's rows");
  const int64_t row = keys.size(1) * keys.size(2);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == keys.size(2),
                "write_kv: each row of k and v must be contiguous (its heads one after another)");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "write_kv: slots must be contiguous int64 (T,)");
  const int64_t num_slots = keys.size(0), tokens = k.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot ", sp[t], " outside the pool of ", num_slots);
  }
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  // Checked above: nothing may throw in the parallel region. Threads for prefill-sized writes only.
  if (keys.scalar_type() == at::kBFloat16) {
    uint16_t* kp = reinterpret_cast<uint16_t*>(keys.data_ptr<at::BFloat16>());
    uint16_t* vp = reinterpret_cast<uint16_t*>(values.data_ptr<at::BFloat16>());
    kvcache_par::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        round_row_bf16(ks + t * k_stride, kp + sp[t] * row, row);
        round_row_bf16(vs + t * v_stride, vp + sp[t] * row, row);
      }
    });
    return;
  }
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  kvcache_par::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kp + sp[t] * row, ks + t * k_stride, row * sizeof(float));
      std::memcpy(vp + sp[t] * row, vs + t * v_stride, row * sizeof(float));
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def("write_kv(Tensor(a!) keys, Tensor(b!) values, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("write_kv", write_kv);
}
