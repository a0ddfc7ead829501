// DecoderStack (torch.classes.stagewise.DecoderStack): a decode step through a stage's pre-norm
// decoder layers (Llama, Qwen3) in one call, the layer loop in C++.
//
// Why: at batch 1 a layer's kernels take tens of microseconds, and the same layer driven from
// Python (nn.Module calls, views, one dispatcher round trip from Python per op) costs about as
// much again. The stack holds every layer's weights once (built by
// python/stagewise/model/decode_stack.py) and runs the very ops the Python layers run, through
// the dispatcher from C++, in the same order with the same arguments: the results are the
// same bits. It serves decode steps (every row one new token), prompt steps whose prompts all
// start at position 0 (attention: torch's SDPA, causal, over each prompt's own tokens), and steps
// of short runs of tokens after each request's cache (see extend: speculative decoding's verifying
// rows, a draft model catching up); long prompt chunks after a cache, steps that mix them with
// fresh prompts, images and context parallelism take the Python layers.
//
// One step, per layer (x [B, hidden] and residual [B, hidden], updated in place):
//   residual += x; x = rms_norm(residual)        (the first layer of stage 0: residual = x)
//   qkv = linear(x); rope (or Qwen3's qk_norm_rope) on q, k
//   attn = decode_attention(q over the cache plus k, v); reshape_and_cache(k, v)
//     (a step with prompt tokens: reshape_and_cache(k, v) first, then extend_attention over the
//     prompt runs and decode_attention over the decode rows)
//   x = linear_o(attn); residual += x; x = rms_norm(residual)
//   gate, up = linear_gate_up(x); x = linear_down(act(gate) * up)
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace stagewise::glue {
namespace {

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using OptT = std::optional<at::Tensor>;

// A linear: dense weight [out, in] (qtype < 0) through dense_linear, GGUF blocks through
// quant_linear, or the int8 mode's packed panels through quant_linear_int8.
struct Linear {
  at::Tensor weight;
  int64_t qtype = -1;
  bool int8 = false;
  int64_t out_features = 0;
  OptT bias;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  OptT q_norm, k_norm;
  Linear qkv, o, gate_up, down;
};

enum Activation : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3 };

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, bool is_neox, double scale,
               at::Tensor cos_sin_cache, int64_t activation)
      : hq_(num_heads), hk_(num_kv_heads), d_(head_dim), eps_(eps), neox_(is_neox), scale_(scale),
        cos_sin_(std::move(cos_sin_cache)), act_(activation) {
    TORCH_CHECK_VALUE(hq_ > 0 && hk_ > 0 && d_ > 0 && hq_ % hk_ == 0, "DecoderStack: heads must be positive with ",
                      "num_heads a multiple of num_kv_heads, got ", hq_, ", ", hk_, ", head_dim ", d_);
    TORCH_CHECK_VALUE(act_ >= kSilu && act_ <= kRelu, "DecoderStack: unknown activation code ", act_);
  }

  int64_t add_layer(at::Tensor input_norm, at::Tensor post_norm, OptT q_norm, OptT k_norm) {
    TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(), "DecoderStack.add_layer: give q_norm and k_norm "
                      "together (Qwen3) or neither");
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), {}, {}, {}, {}});
    return static_cast<int64_t>(layers_.size()) - 1;
  }

  // slot: 0 qkv, 1 o, 2 gate_up, 3 down.
  void set_linear(int64_t layer, int64_t slot, at::Tensor weight, int64_t qtype, bool int8, int64_t out_features,
                  OptT bias) {
    TORCH_CHECK_INDEX(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "DecoderStack.set_linear: layer ",
                      layer, " is out of range [0, ", layers_.size(), ")");
    TORCH_CHECK_INDEX(slot >= 0 && slot < 4, "DecoderStack.set_linear: slot must be 0-3, got ", slot);
    Layer& l = layers_[layer];
    Linear* target[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    *target[slot] = {std::move(weight), qtype, int8, out_features, std::move(bias)};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // One decode step of B rows through every layer. kv [layers, 2, blocks, block_size, Hk, D]: the
  // stage's cache, layer i at kv[i]; scales [layers, 2, blocks, block_size, Hk] float16 with a
  // compact cache (int8 or fp8 codes), else None. has_residual false: residual is taken from x
  // (stage 0).
  void decode(at::Tensor x, at::Tensor residual, bool has_residual, at::Tensor positions, at::Tensor slot_mapping,
              at::Tensor block_tables, at::Tensor seq_lens, at::Tensor kv, OptT scales) {
    static auto attention = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, double, const OptT&, const OptT&, int64_t,
                                    int64_t, const OptT&, const OptT&)>("stagewise::decode_attention");
    static auto cache = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                const OptT&, const OptT&)>("stagewise::reshape_and_cache");
    check(x, residual, kv, scales, "decode");
    at::Tensor lse = at::empty({x.size(0), hq_}, x.options().dtype(at::kFloat));
    if (scales.has_value()) {
      // A compact cache: the new K/V go in first and each row reads them as stored (its length and
      // itself), as the Python layers do, so that every query sees the cache's values.
      const at::Tensor lens = seq_lens + 1;
      run(x, residual, has_residual, positions, slot_mapping, kv, scales, /*cache_after=*/false,
          [&](at::Tensor& attn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& k_cache, const at::Tensor& v_cache, const OptT& k_scale, const OptT& v_scale) {
            at::Tensor kc = k_cache, vc = v_cache;
            cache.call(k, v, kc, vc, slot_mapping, k_scale, v_scale);
            attention.call(attn, lse, q, k_cache, v_cache, block_tables, lens, scale_, std::nullopt, std::nullopt,
                           0, 0, k_scale, v_scale);
          });
      return;
    }
    run(x, residual, has_residual, positions, slot_mapping, kv, scales, /*cache_after=*/true,
        [&](at::Tensor& attn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const OptT& k_scale, const OptT& v_scale) {
          attention.call(attn, lse, q, k_cache, v_cache, block_tables, seq_lens, scale_, k, v, 0, 0, k_scale, v_scale);
        });
  }

  // A step with prompt tokens: P runs of new tokens, each after its request's cache (a prompt from
  // its first token, a later chunk, a prefix-cache hit, drafts being verified), then decode rows.
  // The runs are x's first query_start_loc[P] rows, one after another (query_start_loc [P + 1], from
  // 0); block_tables [R, W] and seq_lens [R] (cached tokens before the step) hold each run's request,
  // then each decode row's, as decode() takes them; run_lens [P]: each run's request's tokens after
  // the step (its cache and the run, what it attends over). Each layer writes the step's K/V into
  // the cache first; the runs attend causally over the cache through extend_attention (a run's
  // tokens share every K/V row they read), the decode rows as in decode().
  void extend(at::Tensor x, at::Tensor residual, bool has_residual, at::Tensor positions, at::Tensor slot_mapping,
              at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor run_lens,
              at::Tensor kv, OptT scales) {
    static auto runs = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                               const OptT&, const OptT&)>("stagewise::extend_attention");
    static auto attention = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, double, const OptT&, const OptT&, int64_t,
                                    int64_t, const OptT&, const OptT&)>("stagewise::decode_attention");
    static auto cache = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                const OptT&, const OptT&)>("stagewise::reshape_and_cache");
    check(x, residual, kv, scales, "extend");
    const int64_t num_runs = query_start_loc.dim() == 1 ? query_start_loc.size(0) - 1 : -1;
    TORCH_CHECK_VALUE(num_runs >= 1 && query_start_loc.device().is_cpu(), "DecoderStack.extend: query_start_loc "
                      "must be a CPU tensor [P + 1] of at least one run, got ", query_start_loc.sizes());
    const int64_t run_rows = query_start_loc[num_runs].item<int64_t>(), rows = x.size(0);
    const int64_t decodes = rows - run_rows, lines = num_runs + decodes;
    TORCH_CHECK_VALUE(run_rows >= 0 && run_rows <= rows && block_tables.dim() == 2 &&
                          block_tables.size(0) == lines && seq_lens.dim() == 1 && seq_lens.size(0) == lines &&
                          run_lens.dim() == 1 && run_lens.size(0) == num_runs,
                      "DecoderStack.extend: the runs' ", run_rows, " rows of x (", rows, ") and its other rows need ",
                      "one row of block_tables and seq_lens per run and per decode row (", lines, ") and run_lens ",
                      "per run (", num_runs, "), got ", block_tables.sizes(), ", ", seq_lens.sizes(), " and ",
                      run_lens.sizes());
    const at::Tensor run_tables = block_tables.narrow(0, 0, num_runs);
    const at::Tensor tables = block_tables.narrow(0, num_runs, decodes);
    const at::Tensor lens = seq_lens.narrow(0, num_runs, decodes) + (scales.has_value() ? 1 : 0);
    at::Tensor lse = at::empty({decodes, hq_}, x.options().dtype(at::kFloat));
    run(x, residual, has_residual, positions, slot_mapping, kv, scales, /*cache_after=*/false,
        [&](at::Tensor& attn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const OptT& k_scale, const OptT& v_scale) {
          at::Tensor kc = k_cache, vc = v_cache;
          cache.call(k, v, kc, vc, slot_mapping, k_scale, v_scale);
          at::Tensor run_out = attn.narrow(0, 0, run_rows);
          runs.call(run_out, q.narrow(0, 0, run_rows), k_cache, v_cache, run_tables, query_start_loc, run_lens,
                    scale_, 0, k_scale, v_scale);
          if (decodes == 0) return;
          at::Tensor out = attn.narrow(0, run_rows, decodes);
          const at::Tensor qd = q.narrow(0, run_rows, decodes);
          if (scales.has_value()) {  // each decode row reads its new K/V as stored, as in decode()
            attention.call(out, lse, qd, k_cache, v_cache, tables, lens, scale_, std::nullopt, std::nullopt, 0, 0,
                           k_scale, v_scale);
          } else {
            attention.call(out, lse, qd, k_cache, v_cache, tables, lens, scale_, k.narrow(0, run_rows, decodes),
                           v.narrow(0, run_rows, decodes), 0, 0, k_scale, v_scale);
          }
        });
  }

 private:
  void check(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& kv, const OptT& scales,
             const char* what) const {
    TORCH_CHECK_VALUE(x.dim() == 2 && residual.sizes() == x.sizes(), "DecoderStack.", what, ": x and residual must ",
                      "be [B, hidden] alike, got ", x.sizes(), " and ", residual.sizes());
    TORCH_CHECK_VALUE(kv.dim() == 6 && kv.size(0) == num_layers() && kv.size(1) == 2, "DecoderStack.", what,
                      ": kv must be [", num_layers(), ", 2, blocks, block_size, Hk, D], got ", kv.sizes());
    TORCH_CHECK_VALUE(!scales.has_value() || (scales->dim() == 5 && scales->sizes() == kv.sizes().slice(0, 5)),
                      "DecoderStack.", what, ": scales must be None or [", num_layers(),
                      ", 2, blocks, block_size, Hk] as kv, got ", scales.has_value() ? scales->sizes() : kv.sizes());
  }

  // Every layer over x (updated in place with residual); attend(attn, q, k, v, k_cache, v_cache,
  // k_scale, v_scale) fills attn [B, Hq, D], and then, with cache_after, the new K/V go into the
  // cache (without: attend wrote them first).
  template <typename Attend>
  void run(at::Tensor& x, at::Tensor& residual, bool has_residual, const at::Tensor& positions,
           const at::Tensor& slot_mapping, const at::Tensor& kv, const OptT& scales, bool cache_after,
           Attend&& attend) {
    static auto rms_norm =
        op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool)>("stagewise::rms_norm");
    static auto fused_norm =
        op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double, bool)>("stagewise::fused_add_rms_norm");
    static auto rope = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>("stagewise::rope");
    static auto qk_norm_rope = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, const at::Tensor&, double, bool, bool)>(
        "stagewise::qk_norm_rope");
    static auto cache = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                const OptT&, const OptT&)>("stagewise::reshape_and_cache");
    const int64_t b = x.size(0), q_cols = hq_ * d_, kv_cols = hk_ * d_;
    at::Tensor attn = at::empty({b, hq_, d_}, x.options());
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& l = layers_[i];
      if (i == 0 && !has_residual) {
        residual.copy_(x);
        rms_norm.call(x, residual, l.input_norm, eps_, false);
      } else {
        fused_norm.call(x, residual, l.input_norm, eps_, false);
      }
      at::Tensor qkv = linear(x, l.qkv);
      at::Tensor q = qkv.narrow(1, 0, q_cols).view({b, hq_, d_});
      at::Tensor k = qkv.narrow(1, q_cols, kv_cols).view({b, hk_, d_});
      at::Tensor v = qkv.narrow(1, q_cols + kv_cols, kv_cols).view({b, hk_, d_});
      if (l.q_norm.has_value()) {
        qk_norm_rope.call(q, k, *l.q_norm, *l.k_norm, positions, cos_sin_, eps_, neox_, false);
      } else {
        rope.call(q, k, positions, cos_sin_, neox_);
      }
      at::Tensor k_cache = kv[i][0], v_cache = kv[i][1];
      OptT k_scale, v_scale;
      if (scales.has_value()) k_scale = (*scales)[i][0], v_scale = (*scales)[i][1];
      attend(attn, q, k, v, k_cache, v_cache, k_scale, v_scale);
      if (cache_after) cache.call(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
      at::Tensor h = linear(attn.view({b, q_cols}), l.o);
      fused_norm.call(h, residual, l.post_norm, eps_, false);
      at::Tensor gate_up = linear(h, l.gate_up);
      const int64_t inter = gate_up.size(1) / 2;
      at::Tensor act = activate(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
      x.copy_(linear(act, l.down));
    }
  }

  at::Tensor linear(const at::Tensor& x, const Linear& w) const {
    static auto dense = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&)>(
        "stagewise::dense_linear");
    static auto quant = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptT&)>(
        "stagewise::quant_linear");
    static auto quant_int8 = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptT&)>(
        "stagewise::quant_linear_int8");
    at::Tensor out = at::empty({x.size(0), w.out_features}, x.options());
    if (w.qtype < 0) {
      dense.call(out, x, w.weight, w.bias);
    } else {
      (w.int8 ? quant_int8 : quant).call(out, x, w.weight, w.qtype, w.bias);
    }
    return out;
  }

  at::Tensor activate(const at::Tensor& gate) const {
    switch (act_) {
      case kGelu: return at::gelu(gate);
      case kGeluTanh: return at::gelu(gate, "tanh");
      case kRelu: return at::relu(gate);
      default: return at::silu(gate);
    }
  }

  int64_t hq_, hk_, d_;
  double eps_;
  bool neox_;
  double scale_;
  at::Tensor cos_sin_;
  int64_t act_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagewise, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, bool, double, at::Tensor, int64_t>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_linear", &DecoderStack::set_linear)
      .def("num_layers", &DecoderStack::num_layers)
      .def("decode", &DecoderStack::decode)
      .def("extend", &DecoderStack::extend);
}

}  // namespace stagewise::glue
