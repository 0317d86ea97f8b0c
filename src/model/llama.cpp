#include "model/llama.h"

#include <cmath>
#include <cstring>

#include "autograd/lora.h"
#include "base/hash.h"
#include "base/rng.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/gemm.h"
#include "ops/rope.h"

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

Tensor iota_rows(int64_t b, int64_t t) {
  Tensor pos = Tensor::empty({b, t}, DType::i32);
  int32_t* p = pos.data<int32_t>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < t; ++j) p[i * t + j] = static_cast<int32_t>(j);
  return pos;
}

}  // namespace

Tensor window_starts(const Tensor& seg_start, int64_t window) {
  if (window <= 0) return seg_start;
  Tensor out = seg_start.clone();
  const int64_t b = out.size(0), t = out.size(1);
  int32_t* p = out.data<int32_t>();
  for (int64_t r = 0; r < b; ++r)
    for (int64_t j = 0; j < t; ++j)
      p[r * t + j] = static_cast<int32_t>(std::max<int64_t>(p[r * t + j], j - window + 1));
  return out;
}

Batch Batch::contiguous_rows(const Tensor& tokens, const Tensor& targets) {
  Batch b;
  b.tokens = tokens;
  b.targets = targets;
  b.positions = iota_rows(tokens.size(0), tokens.size(1));
  b.doc_ids = Tensor::zeros(tokens.shape(), DType::i32);
  return b;
}

Llama::Llama(const LlamaConfig& config, uint64_t seed, DType dtype)
    : Llama(config, ParamSource{}, dtype) {
  // Matrices (in construction order) take one counter-based stream each; norms are ones and
  // biases zeros, as HF initialises them.
  Rng root(seed);
  uint64_t stream = 0;
  for (auto& [name, v] : named_parameters_in_construction_order()) {
    Tensor t;
    if (name.ends_with("norm.weight")) {
      t = Tensor::full(v.value().shape(), 1.0, dtype);
    } else if (name.ends_with(".bias")) {
      t = Tensor::full(v.value().shape(), 0.0, dtype);
    } else {
      t = normal_param(v.value().shape(), config_.initializer_range, root.fork(stream++), dtype,
                       name)
              .value();
    }
    std::memcpy(v.value().raw(), t.raw(), t.nbytes());
  }
}

Llama::Llama(const LlamaConfig& config, const ParamSource& source, DType dtype)
    : config_(config), dtype_(dtype), tie_(config.tie_word_embeddings) {
  config_.validate();
  const int64_t h = config_.hidden_size, d = config_.resolved_head_dim();
  const int64_t q = config_.num_attention_heads * d, kv = config_.num_key_value_heads * d;
  const int64_t f = config_.intermediate_size, v = config_.vocab_size;
  auto param = [&](const Shape& shape, const std::string& name) {
    Tensor t;
    if (source) {
      t = source(name, shape);
      POLLEN_CHECK(t.shape() == shape && t.dtype() == dtype && t.is_contiguous(), "model '",
                   config_.name, "': parameter '", name, "' came as ", shape_str(t.shape()), " ",
                   dtype_name(t.dtype()), ", expected ", shape_str(shape), " ", dtype_name(dtype));
    } else {
      t = Tensor::empty(shape, dtype);
    }
    return ag::Var(t, true, name);
  };
  embed_tokens_ = param({v, h}, "model.embed_tokens.weight");
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    LayerParams p;
    p.input_norm = param({h}, pre + "input_layernorm.weight");
    p.q_proj = param({q, h}, pre + "self_attn.q_proj.weight");
    p.k_proj = param({kv, h}, pre + "self_attn.k_proj.weight");
    p.v_proj = param({kv, h}, pre + "self_attn.v_proj.weight");
    p.o_proj = param({h, q}, pre + "self_attn.o_proj.weight");
    if (config_.attention_bias) {
      p.q_bias = param({q}, pre + "self_attn.q_proj.bias");
      p.k_bias = param({kv}, pre + "self_attn.k_proj.bias");
      p.v_bias = param({kv}, pre + "self_attn.v_proj.bias");
    }
    p.post_attention_norm = param({h}, pre + "post_attention_layernorm.weight");
    p.gate_proj = param({f, h}, pre + "mlp.gate_proj.weight");
    p.up_proj = param({f, h}, pre + "mlp.up_proj.weight");
    p.down_proj = param({h, f}, pre + "mlp.down_proj.weight");
    layers_.push_back(std::move(p));
  }
  norm_ = param({h}, "model.norm.weight");
  if (!tie_) lm_head_ = param({v, h}, "lm_head.weight");
}

// HF's order, which checkpoints and exports list.
constexpr ag::Var LayerParams::*kNamedOrder[] = {
    &LayerParams::input_norm, &LayerParams::q_proj,  &LayerParams::q_bias,
    &LayerParams::k_proj,     &LayerParams::k_bias,  &LayerParams::v_proj,
    &LayerParams::v_bias,     &LayerParams::o_proj,  &LayerParams::post_attention_norm,
    &LayerParams::gate_proj,  &LayerParams::up_proj, &LayerParams::down_proj};

// The order in which the seeded constructor has always drawn: norms, q, k, v, o, (biases), norm,
// gate, up, down.
constexpr ag::Var LayerParams::*kConstructionOrder[] = {
    &LayerParams::input_norm, &LayerParams::q_proj,  &LayerParams::k_proj,
    &LayerParams::v_proj,     &LayerParams::o_proj,  &LayerParams::q_bias,
    &LayerParams::k_bias,     &LayerParams::v_bias,  &LayerParams::post_attention_norm,
    &LayerParams::gate_proj,  &LayerParams::up_proj, &LayerParams::down_proj};

std::vector<std::pair<std::string, ag::Var>> Llama::collect_parameters(
    std::span<ag::Var LayerParams::*const> layer_order) const {
  std::vector<std::pair<std::string, ag::Var>> out;
  auto add = [&](const ag::Var& v) {
    if (v.defined()) out.emplace_back(v.name(), v);
  };
  add(embed_tokens_);
  for (const auto& p : layers_)
    for (ag::Var LayerParams::*field : layer_order) add(p.*field);
  add(norm_);
  if (!tie_) add(lm_head_);
  return out;
}

std::vector<std::pair<std::string, ag::Var>> Llama::named_parameters_in_construction_order() const {
  return collect_parameters(kConstructionOrder);
}

std::vector<std::pair<std::string, ag::Var>> Llama::named_parameters() const {
  return collect_parameters(kNamedOrder);
}

std::vector<ag::Var> Llama::parameters() const {
  std::vector<ag::Var> out;
  for (auto& [name, v] : named_parameters()) out.push_back(v);
  return out;
}

ag::Var Llama::project(int64_t layer, LoraTarget target, const ag::Var& x, const ag::Var& w,
                       uint64_t forward, const ag::Var* bias) const {
  if (lora_) {
    const LoraAdapter& ad = lora_->adapter(layer, target);
    if (ad.defined())
      return ag::lora_linear(x, w, bias, ad.a, ad.b, lora_->scale(),
                             lora_->dropout_mask(layer, target, x.size(0), w.size(1), forward));
  }
  return ag::linear(x, w, bias);
}

// One pre-norm block on x (B*T, C):
//   x = x + o_proj(attention(rope(q), rope(k), v))   with q, k, v from rmsnorm(x)
//   x = x + down_proj(silu(gate_proj(h)) * up_proj(h))   with h = rmsnorm(x)
// Each projection carries its LoRA adapter when one is attached.
ag::Var Llama::block(int64_t layer, const ag::Var& x, const Batch& batch, const Tensor& seg_start,
                     uint64_t forward) const {
  const LayerParams& p = layers_[static_cast<size_t>(layer)];
  const int64_t b = batch.tokens.size(0), t = batch.tokens.size(1);
  const int64_t d = config_.resolved_head_dim();
  const int64_t nh = config_.num_attention_heads, nkv = config_.num_key_value_heads;
  const double eps = config_.rms_norm_eps;
  const ops::RopeParams rope = config_.rope_params();
  using enum LoraTarget;

  ag::Var h = ag::rmsnorm(x, p.input_norm, eps);
  auto bias = [](const ag::Var& v) { return v.defined() ? &v : nullptr; };
  ag::Var q =
      ag::reshape(project(layer, q_proj, h, p.q_proj, forward, bias(p.q_bias)), {b, t, nh, d});
  ag::Var k =
      ag::reshape(project(layer, k_proj, h, p.k_proj, forward, bias(p.k_bias)), {b, t, nkv, d});
  ag::Var v =
      ag::reshape(project(layer, v_proj, h, p.v_proj, forward, bias(p.v_bias)), {b, t, nkv, d});
  q = ag::rope(q, batch.positions, rope);
  k = ag::rope(k, batch.positions, rope);
  ag::Var a = ag::attention(q, k, v, seg_start, 1.0 / std::sqrt(static_cast<double>(d)));
  ag::Var x1 =
      ag::add(x, project(layer, o_proj, ag::reshape(a, {b * t, nh * d}), p.o_proj, forward));

  ag::Var h2 = ag::rmsnorm(x1, p.post_attention_norm, eps);
  ag::Var m = ag::swiglu(project(layer, gate_proj, h2, p.gate_proj, forward),
                         project(layer, up_proj, h2, p.up_proj, forward));
  return ag::add(x1, project(layer, down_proj, m, p.down_proj, forward));
}

void Llama::to(Device device) {
  if (device == device_) return;
  POLLEN_CHECK(!lora_, "model '", config_.name, "': a model with LoRA adapters stays on the ",
               device_name(device_));
  if (device == Device::cuda) require_gpu("model '" + config_.name + "'");
  for (auto& [name, v] : named_parameters()) {
    v.node()->value = v.value().to(device);
    v.node()->grad = Tensor();
  }
  device_ = device;
}

Tensor Llama::on_device(const Tensor& t) const {
  return t.device() == device_ ? t : t.to(device_);
}

ag::Var Llama::hidden_states(const Batch& batch) const {
  POLLEN_CHECK(batch.tokens.dim() == 2, "model input: tokens must be (batch, seq), got ",
               shape_str(batch.tokens.shape()));
  const int64_t b = batch.tokens.size(0), t = batch.tokens.size(1);
  Batch full = batch;
  if (!full.positions.defined()) full.positions = iota_rows(b, t);
  if (!full.doc_ids.defined()) full.doc_ids = Tensor::zeros({b, t}, DType::i32);
  // Document starts come from the host's ids; then everything the layers read moves over.
  const Tensor seg_start =
      on_device(window_starts(ops::segment_starts(full.doc_ids), config_.sliding_window));
  full.tokens = on_device(full.tokens);
  // The GPU's rope trusts its positions: checked here, once per batch, before they move.
  if (device_ == Device::cuda) ops::check_rope_positions(full.positions);
  full.positions = on_device(full.positions);

  const uint64_t forward = lora_ ? lora_->next_dropout_forward() : 0;
  ag::Var x = ag::embedding(embed_tokens_, full.tokens);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    if (recompute_) {
      // The layer's adapters are captured parameters: with the base frozen they may be the only
      // reason to record.
      std::vector<ag::Var> adapters;
      for (int target = 0; lora_ && target < kLayerTargets; ++target) {
        const LoraAdapter& ad = lora_->adapter(l, static_cast<LoraTarget>(target));
        if (ad.defined()) adapters.insert(adapters.end(), {ad.a, ad.b});
      }
      x = ag::checkpoint(
          [this, l, full, seg_start, forward](const std::vector<ag::Var>& in) {
            return block(l, in[0], full, seg_start, forward);
          },
          {x}, adapters);
    } else {
      x = block(l, x, full, seg_start, forward);
    }
  }
  return ag::rmsnorm(x, norm_, config_.rms_norm_eps);
}

ag::Var Llama::loss(const Batch& batch, ag::Reduction reduction, int64_t* scored) const {
  POLLEN_CHECK(batch.targets.defined() && batch.targets.shape() == batch.tokens.shape(),
               "model loss: targets must have the shape of tokens ",
               shape_str(batch.tokens.shape()));
  return ag::cross_entropy(hidden_states(batch), head_weight(), on_device(batch.targets), reduction,
                           scored);
}

double Llama::loss_sum(const Batch& batch, int64_t* scored) const {
  POLLEN_CHECK(batch.targets.defined() && batch.targets.shape() == batch.tokens.shape(),
               "model loss: targets must have the shape of tokens ",
               shape_str(batch.tokens.shape()));
  ag::NoGrad no_grad;
  const ag::Var w = head_weight();
  const Tensor h = hidden_states(batch).value().reshape({-1, w.size(1)});
  return ops::cross_entropy_forward(h, w.value(), on_device(batch.targets).reshape({-1}), scored);
}

Tensor Llama::logits(const Batch& batch) const {
  ag::NoGrad no_grad;
  ag::Var h = hidden_states(batch);
  const ag::Var w = head_weight();
  Tensor out = Tensor::empty({h.size(0), w.size(0)}, dtype_, device_);
  ops::gemm(h.value(), false, w.value(), true, out);
  return out;
}

ag::Var Llama::head_weight() const {
  if (lora_ && lora_->head().defined())
    return ag::lora_weight(output_head(), lora_->head().a, lora_->head().b, lora_->scale());
  return output_head();
}

void Llama::attach_lora(std::shared_ptr<const Lora> lora) {
  POLLEN_CHECK(lora != nullptr, "attach_lora: no adapters");
  const LlamaConfig& l = lora->model_config();
  POLLEN_CHECK(
      l.hidden_size == config_.hidden_size && l.intermediate_size == config_.intermediate_size &&
          l.num_hidden_layers == config_.num_hidden_layers &&
          l.num_attention_heads == config_.num_attention_heads &&
          l.num_key_value_heads == config_.num_key_value_heads &&
          l.resolved_head_dim() == config_.resolved_head_dim() &&
          l.vocab_size == config_.vocab_size && l.tie_word_embeddings == tie_,
      "attach_lora: the adapters were made for a model of another shape than '", config_.name, "'");
  POLLEN_CHECK(lora->dtype() == dtype_, "attach_lora: adapters in ", dtype_name(lora->dtype()),
               " for a model in ", dtype_name(dtype_));
  lora_ = std::move(lora);
  for (auto& [name, v] : named_parameters()) v.node()->requires_grad = false;
}

void Llama::detach_lora() {
  lora_.reset();
  for (auto& [name, v] : named_parameters()) v.node()->requires_grad = true;
}

Llama Llama::without_lora() const {
  Llama base = *this;
  base.lora_.reset();
  return base;
}

std::string weights_sha256(const Llama& model) {
  Sha256 h;
  for (const auto& [name, v] : model.named_parameters()) {
    h.update(name);
    const Tensor t = v.value().to(DType::f32).contiguous();
    h.update(t.raw(), t.nbytes());
  }
  return h.hex_digest();
}

}  // namespace pollen::model
