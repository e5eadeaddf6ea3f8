// Every decoder layer of a step in one op: for each layer, `layer_qkv`, the attention of
// every tile of the step's plan (computed/attention.py's `attend` on the native kernels),
// then `layer_out`. The same kernels in the same order on the same tensors as the Python
// loop of computed/model/native.py, so the results are bit for bit that loop's
// (tests/computed/test_forward_layers.py).
//
// Why: a decode step's kernels are short, and the Python between them was not. py-spy of
// a standalone decode burst (8 rows x 1,100 keys, bfloat16 pool, 2 threads) put 19.5% of
// the main thread's samples in Python outside any op call after layer.cpp: the layer
// loop, `attend`'s views and checks, `_attend_tile`'s branches. Here a step is one call:
// the same burst 1.39-1.48 -> 1.24-1.28 ms a step (interleaved with the loop's build), the
// daemons' chat workload's medians about 0.97 -> 0.93 s (three interleaved pairs of 4 runs).
// `python -m bench.attention_kernels` (decode steps block) times the same step.
//
// kvcache::forward_layers(x, h, layers, bias, q_norm, k_norm, layer_ids, num_heads,
//     num_kv_heads, head_dim, gate_up_size, scale, eps, cos, sin, kv, write_slots,
//     write_index, tiles, causal, in_order, merge_index) -> h
//   x           (T, hidden)  float32, the residual stream (the embeddings)
//   h           (T, hidden)  float32, x normed by the first layer's input norm
//   layers      per layer 6 tensors, in order: qkv, o, post_norm, gate_up, down (packed
//               as layer_qkv and layer_out take them), then the next layer's input norm
//               (the final norm after the last layer)
//   bias, q_norm, k_norm     per layer, each a tensor or None (as layer_qkv takes them)
//   layer_ids   per layer, its index in the pool
//   cos, sin    (T, D)       float32, each token's rotary table rows
//   kv          (layers, 2, N, B, Hkv, D) the KV pool, float32 or bfloat16: the new K/V go in
//   write_slots (W,) int64, write_index (W,) int64 or None: as layer_qkv's
//   tiles       per tile 5 tensors: query_rows (I, Qm), key_slots (I, Lm), key_lens (I,),
//               valid (P,), valid_rows (P,), all int64 (computed.attention.Tile's)
//   causal, in_order  per tile
//   merge_index (T, depth) int64 or None: as merge_partials takes it
//   read_rows   (S,) int64 or None: the rows whose hidden states are read (computed/output_rows.py):
//               the last layer runs past its q/k/v product (which writes every row's K/V) for
//               them alone, attending through read_tiles, read_causal, read_in_order and
//               read_merge_index (the rows' own plan, as tiles, causal, in_order, merge_index)
//   h           (T, hidden)  float32: the last layer's output, final-normed; (S, hidden)
//               with read_rows
// Why read_rows: a prefill step samples its chunks' last rows, and ran the Python loop of
// computed/model/native.py for it, op by op: ~4% of a warm 4,096+64 prefill's forward was
// that Python and the op calls around the kernels (py-spy --native, default model, 1 thread).
// A tile of one query per item that is not causal runs paged_decode, any other paged_flash;
// the caller makes sure both take the pool and the head shapes (computed/model/native.py).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using Opt = std::optional<at::Tensor>;
using Pair = std::tuple<at::Tensor, at::Tensor>;
using T = const at::Tensor&;

template <class F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

constexpr int64_t kPerLayer = 6;  // qkv, o, post_norm, gate_up, down, next_norm
constexpr int64_t kPerTile = 5;   // query_rows, key_slots, key_lens, valid, valid_rows

// computed/attention.py's `attend` and `_attend_tile` where every tile runs a native kernel.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::TensorList tiles,
                  const c10::List<bool>& causal, const c10::List<bool>& in_order, const Opt& merge_index, double scale) {
  static const auto decode = op<Pair(T, T, T, T, T, double)>("kvcache::paged_decode");
  static const auto flash = op<Pair(T, T, T, T, T, bool, double)>("kvcache::paged_flash");
  static const auto merge = op<at::Tensor(at::TensorList, at::TensorList, T)>("kvcache::merge_partials");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_tiles = static_cast<int64_t>(causal.size());
  std::vector<at::Tensor> outs, lses;
  outs.reserve(num_tiles);
  lses.reserve(num_tiles);
  for (int64_t t = 0; t < num_tiles; ++t) {
    const at::Tensor& rows = tiles[t * kPerTile];
    const at::Tensor& slots = tiles[t * kPerTile + 1];
    const at::Tensor& lens = tiles[t * kPerTile + 2];
    const int64_t items = rows.size(0), width_q = rows.size(1);
    if (width_q == 1 && !causal.get(t)) {  // one query per item: no gather of K/V
      auto [o, lse] = decode.call(in_order.get(t) ? q.contiguous() : q.index_select(0, rows.view(-1)), keys, values,
                                  slots, lens, scale);
      outs.push_back(std::move(o));
      lses.push_back(std::move(lse));
      continue;
    }
    const at::Tensor qt = (in_order.get(t) ? q.reshape({items, width_q, heads, dim})
                                       : q.index_select(0, rows.view(-1)).view({items, width_q, heads, dim}))
                              .contiguous();
    auto [o, lse] = flash.call(qt, keys, values, slots, lens, causal.get(t), scale);
    outs.push_back(o.view({items * width_q, heads, dim}));
    lses.push_back(lse.view({items * width_q, heads}));
  }
  if (num_tiles == 1 && in_order.get(0)) return outs[0];  // every row once, in order (a plain decode step)
  if (!merge_index.has_value()) {  // one partial per query row: place them
    at::Tensor out = at::empty({tokens, heads, dim}, q.options());
    for (int64_t t = 0; t < num_tiles; ++t)
      out.index_copy_(0, tiles[t * kPerTile + 4], outs[t].index_select(0, tiles[t * kPerTile + 3]));
    return out;
  }
  for (auto& o : outs) o = o.contiguous();
  for (auto& l : lses) l = l.contiguous();
  return merge.call(outs, lses, *merge_index);
}

at::Tensor forward_layers(const at::Tensor& x_in, const at::Tensor& h_in, at::TensorList layers,
                          const c10::List<std::optional<at::Tensor>>& bias,
                          const c10::List<std::optional<at::Tensor>>& q_norm,
                          const c10::List<std::optional<at::Tensor>>& k_norm, at::IntArrayRef layer_ids,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t gate_up_size,
                          double scale, double eps, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& kv, const at::Tensor& write_slots, const Opt& write_index,
                          at::TensorList tiles, const c10::List<bool>& causal, const c10::List<bool>& in_order,
                          const Opt& merge_index, const Opt& read_rows, at::TensorList read_tiles,
                          const c10::List<bool>& read_causal, const c10::List<bool>& read_in_order,
                          const Opt& read_merge_index) {
  static const auto layer_qkv = op<at::Tensor(T, T, const Opt&, const Opt&, const Opt&, T, T, T, int64_t, T,
                                              const Opt&, int64_t, int64_t, int64_t, double)>("kvcache::layer_qkv");
  static const auto layer_out = op<Pair(T, T, T, T, T, T, T, int64_t, double)>("kvcache::layer_out");
  const int64_t num_layers = static_cast<int64_t>(layer_ids.size());
  TORCH_CHECK(num_layers >= 1 && static_cast<int64_t>(layers.size()) == num_layers * kPerLayer &&
                  static_cast<int64_t>(bias.size()) == num_layers &&
                  static_cast<int64_t>(q_norm.size()) == num_layers &&
                  static_cast<int64_t>(k_norm.size()) == num_layers,
              "forward_layers takes ", kPerLayer, " tensors and a bias, q_norm and k_norm per layer");
  const int64_t num_tiles = static_cast<int64_t>(causal.size());
  TORCH_CHECK(num_tiles >= 1 && static_cast<int64_t>(in_order.size()) == num_tiles &&
                  static_cast<int64_t>(tiles.size()) == num_tiles * kPerTile,
              "forward_layers takes ", kPerTile, " tensors, causal and in_order per tile");
  TORCH_CHECK(kv.dim() == 6 && kv.size(4) == num_kv_heads && kv.size(5) == head_dim,
              "forward_layers takes the pool (layers, 2, N, B, Hkv, D)");
  const int64_t num_read_tiles = static_cast<int64_t>(read_causal.size());
  TORCH_CHECK(!read_rows.has_value() || (read_rows->numel() >= 1 && num_read_tiles >= 1 &&
                                         static_cast<int64_t>(read_in_order.size()) == num_read_tiles &&
                                         static_cast<int64_t>(read_tiles.size()) == num_read_tiles * kPerTile),
              "forward_layers takes at least one read row, and ", kPerTile,
              " tensors, causal and in_order per read tile");
  at::Tensor x = x_in, h = h_in;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = layers.data() + l * kPerLayer;
    const int64_t layer = layer_ids[l];
    const at::Tensor q = layer_qkv.call(h, w[0], bias.get(l), q_norm.get(l), k_norm.get(l), cos, sin, kv, layer,
                                        write_slots, write_index, num_heads, num_kv_heads, head_dim, eps);
    const at::Tensor keys = kv.select(0, layer).select(0, 0).view({-1, num_kv_heads, head_dim});  // (N * B, Hkv, D)
    const at::Tensor values = kv.select(0, layer).select(0, 1).view({-1, num_kv_heads, head_dim});
    if (l == num_layers - 1 && read_rows.has_value()) {  // the read rows alone from here on
      const at::Tensor out = attend(q.index_select(0, *read_rows), keys, values, read_tiles, read_causal,
                                    read_in_order, read_merge_index, scale);
      x = x.index_select(0, *read_rows);
      std::tie(h, x) = layer_out.call(out, x, w[1], w[2], w[3], w[4], w[5], gate_up_size, eps);
      break;
    }
    const at::Tensor out = attend(q, keys, values, tiles, causal, in_order, merge_index, scale);
    std::tie(h, x) = layer_out.call(out, x, w[1], w[2], w[3], w[4], w[5], gate_up_size, eps);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.def(
      "forward_layers(Tensor x, Tensor h, Tensor[] layers, Tensor?[] bias, Tensor?[] q_norm, Tensor?[] k_norm, "
      "int[] layer_ids, int num_heads, int num_kv_heads, int head_dim, int gate_up_size, float scale, float eps, "
      "Tensor cos, Tensor sin, Tensor(a!) kv, Tensor write_slots, Tensor? write_index, Tensor[] tiles, "
      "bool[] causal, bool[] in_order, Tensor? merge_index, Tensor? read_rows, Tensor[] read_tiles, "
      "bool[] read_causal, bool[] read_in_order, Tensor? read_merge_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("forward_layers", forward_layers);
}
