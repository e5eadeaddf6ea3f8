// A decoder layer's ops around its attention, composed in C++: `layer_qkv` before the
// attention, `layer_out` after it. Each runs the same kernels (looked up once through
// torch's dispatcher) in the same order on the same tensors as the Python loop of
// computed/model/native.py did op by op, so the results are bit for bit those.
//
// Why: in a decode step the kernels are short, and the Python between them was not.
// py-spy of a standalone decode burst (8 rows x 1,100 keys, bfloat16 pool, 2 threads):
// 26% of the main thread's samples were Python outside any op call (the layer loop's
// splits, views, pool views, the write's checks and lookups); with these two ops, 19.5%
// (most of the rest: the step's attention plan and `attend`). A layer is now two op calls
// and the attention. Interleaved A/B, best of 3 runs (standalone `run_steps`): 8 rows x
// 1,100 keys 1.35 -> 1.30 ms a step, 1 row 0.64 -> 0.57 ms, 64 rows over a shared 1,024
// keys 4.68 -> 4.55 ms; the daemons' chat workload within this machine's noise.
// `python -m bench.attention_kernels` (decode steps block) times the same step.
//
// kvcache::layer_qkv(h, qkv, bias, q_norm, k_norm, cos, sin, kv, layer, write_slots,
//                    write_index, num_heads, num_kv_heads, head_dim, eps) -> q
//   h           (T, hidden)            float32, the layer's normed input
//   qkv         packed (q + 2 kv, hidden), with bias (q + 2 kv,) or None
//   q_norm      (D,) or None           Qwen3's per-head norms (with k_norm)
//   cos, sin    (T, D)                 float32, each token's rotary table rows
//   kv          (layers, 2, N, B, Hkv, D) the KV pool: layer's K/V get the new tokens' K/V
//   write_slots (W,)                   int64, the pool slot of each written token
//   write_index (W,) or None           int64, which tokens those are (None: all T, in order)
//   q           (T, H, D)              float32, rotated: the attention's queries
// kvcache::layer_out(attn, x, o, post_norm, gate_up, down, next_norm, gate_up_size, eps)
//   -> (h, x): x + o(attn), normed; then plus down(silu(gate) * up) of that, normed by
//   next_norm (the next layer's input norm, or the final norm): the next layer's h and
//   the residual stream.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using Opt = std::optional<at::Tensor>;
using Pair = std::tuple<at::Tensor, at::Tensor>;

template <class F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, const Opt& bias, int64_t n) {
  static const auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&, int64_t)>(
      "kvcache::packed_linear");
  return handle.call(x, packed, bias, n);
}

Pair add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  static const auto handle =
      op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("kvcache::add_rms_norm");
  return handle.call(x, residual, weight, eps);
}

at::Tensor layer_qkv(const at::Tensor& h, const at::Tensor& qkv, const Opt& bias, const Opt& q_norm,
                     const Opt& k_norm, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv,
                     int64_t layer, const at::Tensor& write_slots, const Opt& write_index, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, double eps) {
  static const auto rms = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("kvcache::rms_norm");
  static const auto rotary =
      op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kvcache::rotary");
  static const auto write_kv =
      op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "kvcache::write_kv");
  TORCH_CHECK(h.dim() == 2 && kv.dim() == 6 && layer >= 0 && layer < kv.size(0),
              "layer_qkv takes h (T, hidden) and the pool (layers, 2, N, B, Hkv, D), layer ", layer);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "layer_qkv takes both q_norm and k_norm, or neither");
  const int64_t tokens = h.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::Tensor y = product(h, qkv, bias, q_size + 2 * kv_size);  // (T, q + 2 kv)
  at::Tensor q = y.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  at::Tensor k = y.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
  at::Tensor v = y.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  if (q_norm.has_value()) {
    q = rms.call(q.contiguous(), *q_norm, eps);
    k = rms.call(k.contiguous(), *k_norm, eps);
  }
  std::tie(q, k) = rotary.call(q, k, cos, sin);
  if (write_slots.size(0) == 0) return q;
  if (write_index.has_value()) {  // some tokens are not written (a cached prompt's last position)
    k = k.index_select(0, *write_index);
    v = v.index_select(0, *write_index);
  }
  at::Tensor keys = kv.select(0, layer).select(0, 0).view({-1, num_kv_heads, head_dim});  // (N * B, Hkv, D)
  at::Tensor values = kv.select(0, layer).select(0, 1).view({-1, num_kv_heads, head_dim});
  const auto dtype = keys.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == at::kFloat &&
      v.scalar_type() == at::kFloat) {
    write_kv.call(keys, values, k, v, write_slots);  // v read where it lies
  } else {
    keys.index_copy_(0, write_slots, k.to(dtype));
    values.index_copy_(0, write_slots, v.to(dtype));
  }
  return q;
}

Pair layer_out(const at::Tensor& attn, const at::Tensor& x, const at::Tensor& o, const at::Tensor& post_norm,
               const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& next_norm,
               int64_t gate_up_size, double eps) {
  static const auto swiglu =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("kvcache::packed_linear_swiglu");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("kvcache::silu_mul");
  TORCH_CHECK(x.dim() == 2 && attn.size(0) == x.size(0), "layer_out takes attn (T, ...) and x (T, hidden)");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  auto [h, sum] = add_rms_norm(x, product(attn.reshape({tokens, -1}), o, std::nullopt, hidden), post_norm, eps);
  // The fused gate/up product and activation where the intermediate size allows it.
  const at::Tensor up = gate_up_size % 32 == 0 ? swiglu.call(h, gate_up, gate_up_size)
                                               : silu_mul.call(product(h, gate_up, std::nullopt, gate_up_size));
  return add_rms_norm(sum, product(up, down, std::nullopt, hidden), next_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def(
      "layer_qkv(Tensor h, Tensor qkv, Tensor? bias, Tensor? q_norm, Tensor? k_norm, Tensor cos, Tensor sin, "
      "Tensor(a!) kv, int layer, Tensor write_slots, Tensor? write_index, int num_heads, int num_kv_heads, "
      "int head_dim, float eps) -> Tensor");
  m.def(
      "layer_out(Tensor attn, Tensor x, Tensor o, Tensor post_norm, Tensor gate_up, Tensor down, "
      "Tensor next_norm, int gate_up_size, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("layer_qkv", layer_qkv);
  m.impl("layer_out", layer_out);
}
