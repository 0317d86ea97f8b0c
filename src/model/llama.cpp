#include "model/llama.h"

#include <cmath>

#include "base/rng.h"
#include "ops/attention.h"
#include "ops/gemm.h"

namespace pollen::model {
namespace {

ag::Var normal_param(const Shape& shape, double stddev, const Rng& rng, DType dtype,
                     const std::string& name) {
  Tensor t = Tensor::empty(shape, DType::f64);
  Rng r = rng;
  double* p = t.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = stddev * r.normal();
  return ag::Var(t.to(dtype), true, name);
}

ag::Var const_param(const Shape& shape, double value, DType dtype, const std::string& name) {
  return ag::Var(Tensor::full(shape, value, dtype), true, name);
}

Tensor iota_rows(int64_t b, int64_t t) {
  Tensor pos = Tensor::empty({b, t}, DType::i32);
  int32_t* p = pos.data<int32_t>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < t; ++j) p[i * t + j] = static_cast<int32_t>(j);
  return pos;
}

}  // namespace

Batch Batch::contiguous_rows(const Tensor& tokens, const Tensor& targets) {
  Batch b;
  b.tokens = tokens;
  b.targets = targets;
  b.positions = iota_rows(tokens.size(0), tokens.size(1));
  b.doc_ids = Tensor::zeros(tokens.shape(), DType::i32);
  return b;
}

Llama::Llama(const LlamaConfig& config, uint64_t seed, DType dtype)
    : config_(config), dtype_(dtype), tie_(config.tie_word_embeddings) {
  config_.validate();
  const int64_t h = config_.hidden_size, d = config_.resolved_head_dim();
  const int64_t q = config_.num_attention_heads * d, kv = config_.num_key_value_heads * d;
  const int64_t f = config_.intermediate_size, v = config_.vocab_size;
  const double sd = config_.initializer_range;
  Rng root(seed);
  uint64_t stream = 0;
  auto normal = [&](const Shape& s, const std::string& name) {
    return normal_param(s, sd, root.fork(stream++), dtype, name);
  };
  embed_tokens_ = normal({v, h}, "model.embed_tokens.weight");
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    LayerParams p;
    p.input_norm = const_param({h}, 1.0, dtype, pre + "input_layernorm.weight");
    p.q_proj = normal({q, h}, pre + "self_attn.q_proj.weight");
    p.k_proj = normal({kv, h}, pre + "self_attn.k_proj.weight");
    p.v_proj = normal({kv, h}, pre + "self_attn.v_proj.weight");
    p.o_proj = normal({h, q}, pre + "self_attn.o_proj.weight");
    if (config_.attention_bias) {
      p.q_bias = const_param({q}, 0.0, dtype, pre + "self_attn.q_proj.bias");
      p.k_bias = const_param({kv}, 0.0, dtype, pre + "self_attn.k_proj.bias");
      p.v_bias = const_param({kv}, 0.0, dtype, pre + "self_attn.v_proj.bias");
    }
    p.post_attention_norm = const_param({h}, 1.0, dtype, pre + "post_attention_layernorm.weight");
    p.gate_proj = normal({f, h}, pre + "mlp.gate_proj.weight");
    p.up_proj = normal({f, h}, pre + "mlp.up_proj.weight");
    p.down_proj = normal({h, f}, pre + "mlp.down_proj.weight");
    layers_.push_back(std::move(p));
  }
  norm_ = const_param({h}, 1.0, dtype, "model.norm.weight");
  if (!tie_) lm_head_ = normal({v, h}, "lm_head.weight");
}

std::vector<std::pair<std::string, ag::Var>> Llama::named_parameters() const {
  std::vector<std::pair<std::string, ag::Var>> out;
  auto add = [&](const ag::Var& v) {
    if (v.defined()) out.emplace_back(v.name(), v);
  };
  add(embed_tokens_);
  for (const auto& p : layers_) {
    for (const ag::Var* v :
         {&p.input_norm, &p.q_proj, &p.q_bias, &p.k_proj, &p.k_bias, &p.v_proj, &p.v_bias,
          &p.o_proj, &p.post_attention_norm, &p.gate_proj, &p.up_proj, &p.down_proj})
      add(*v);
  }
  add(norm_);
  if (!tie_) add(lm_head_);
  return out;
}

std::vector<ag::Var> Llama::parameters() const {
  std::vector<ag::Var> out;
  for (auto& [name, v] : named_parameters()) out.push_back(v);
  return out;
}

// One pre-norm block on x (B*T, C):
//   x = x + o_proj(attention(rope(q), rope(k), v))   with q, k, v from rmsnorm(x)
//   x = x + down_proj(silu(gate_proj(h)) * up_proj(h))   with h = rmsnorm(x)
ag::Var Llama::block(const LayerParams& p, const ag::Var& x, const Batch& batch,
                     const Tensor& seg_start) const {
  const int64_t b = batch.tokens.size(0), t = batch.tokens.size(1);
  const int64_t d = config_.resolved_head_dim();
  const int64_t nh = config_.num_attention_heads, nkv = config_.num_key_value_heads;
  const double eps = config_.rms_norm_eps, theta = config_.rope_theta;

  ag::Var h = ag::rmsnorm(x, p.input_norm, eps);
  auto bias = [](const ag::Var& v) { return v.defined() ? &v : nullptr; };
  ag::Var q = ag::reshape(ag::linear(h, p.q_proj, bias(p.q_bias)), {b, t, nh, d});
  ag::Var k = ag::reshape(ag::linear(h, p.k_proj, bias(p.k_bias)), {b, t, nkv, d});
  ag::Var v = ag::reshape(ag::linear(h, p.v_proj, bias(p.v_bias)), {b, t, nkv, d});
  q = ag::rope(q, batch.positions, theta);
  k = ag::rope(k, batch.positions, theta);
  ag::Var a = ag::attention(q, k, v, seg_start, 1.0 / std::sqrt(static_cast<double>(d)));
  ag::Var x1 = ag::add(x, ag::linear(ag::reshape(a, {b * t, nh * d}), p.o_proj));

  ag::Var h2 = ag::rmsnorm(x1, p.post_attention_norm, eps);
  ag::Var m = ag::swiglu(ag::linear(h2, p.gate_proj), ag::linear(h2, p.up_proj));
  return ag::add(x1, ag::linear(m, p.down_proj));
}

ag::Var Llama::hidden_states(const Batch& batch) const {
  POLLEN_CHECK(batch.tokens.dim() == 2, "model input: tokens must be (batch, seq), got ",
               shape_str(batch.tokens.shape()));
  const int64_t b = batch.tokens.size(0), t = batch.tokens.size(1);
  Batch full = batch;
  if (!full.positions.defined()) full.positions = iota_rows(b, t);
  if (!full.doc_ids.defined()) full.doc_ids = Tensor::zeros({b, t}, DType::i32);
  const Tensor seg_start = ops::segment_starts(full.doc_ids);

  ag::Var x = ag::embedding(embed_tokens_, full.tokens);
  for (const auto& p : layers_) {
    if (recompute_) {
      x = ag::checkpoint(
          [this, &p, full, seg_start](const std::vector<ag::Var>& in) {
            return block(p, in[0], full, seg_start);
          },
          {x});
    } else {
      x = block(p, x, full, seg_start);
    }
  }
  return ag::rmsnorm(x, norm_, config_.rms_norm_eps);
}

ag::Var Llama::loss(const Batch& batch, ag::Reduction reduction, int64_t* scored) const {
  POLLEN_CHECK(batch.targets.defined() && batch.targets.shape() == batch.tokens.shape(),
               "model loss: targets must have the shape of tokens ",
               shape_str(batch.tokens.shape()));
  return ag::cross_entropy(hidden_states(batch), output_head(), batch.targets, reduction, scored);
}

Tensor Llama::logits(const Batch& batch) const {
  ag::NoGrad no_grad;
  ag::Var h = hidden_states(batch);
  const ag::Var& w = output_head();
  Tensor out = Tensor::empty({h.size(0), w.size(0)}, dtype_);
  ops::gemm(h.value(), false, w.value(), true, out);
  return out;
}

}  // namespace pollen::model
