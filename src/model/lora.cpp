#include "model/lora.h"

#include <cmath>
#include <cstring>
#include <map>

#include "base/config.h"
#include "base/error.h"
#include "base/rng.h"
#include "model/llama.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"

namespace pollen::model {
namespace {

constexpr const char* kTargetNames[] = {"q_proj",    "k_proj",  "v_proj",    "o_proj",
                                        "gate_proj", "up_proj", "down_proj", "lm_head"};
constexpr uint64_t kInitDomain = 0x696e6974;     // "init"
constexpr uint64_t kDropoutDomain = 0x64726f70;  // "drop"

// Where an adapter sits and the shape of the weight it adapts.
struct Slot {
  std::string prefix;  // PEFT's module name: base_model.model.model.layers.0.self_attn.q_proj
  int64_t layer;       // -1 for lm_head
  LoraTarget target;
  int64_t in, out;
};

std::vector<Slot> slots(const LlamaConfig& m, const LoraConfig& c) {
  const int64_t h = m.hidden_size, d = m.resolved_head_dim();
  const int64_t q = m.num_attention_heads * d, kv = m.num_key_value_heads * d;
  const int64_t f = m.intermediate_size;
  const std::pair<int64_t, int64_t> in_out[kLayerTargets] = {{h, q}, {h, kv}, {h, kv}, {q, h},
                                                             {h, f}, {h, f},  {f, h}};
  std::vector<Slot> out;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
    for (int t = 0; t < kLayerTargets; ++t) {
      const auto target = static_cast<LoraTarget>(t);
      if (!c.targets_module(target)) continue;
      const std::string group = t < 4 ? "self_attn." : "mlp.";
      out.push_back(
          {"base_model.model.model.layers." + std::to_string(l) + "." + group + kTargetNames[t], l,
           target, in_out[t].first, in_out[t].second});
    }
  }
  if (c.targets_module(LoraTarget::lm_head))
    out.push_back({"base_model.model.lm_head", -1, LoraTarget::lm_head, h, m.vocab_size});
  return out;
}

// PyTorch's kaiming_uniform_(a = sqrt(5)) on (r, in): U(-1/sqrt(in), 1/sqrt(in)).
Tensor kaiming_uniform(int64_t rows, int64_t in, Rng rng, DType dtype) {
  Tensor t = Tensor::empty({rows, in}, DType::f64);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  double* p = t.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = bound * (2.0 * rng.uniform() - 1.0);
  return t.to(dtype);
}

void check_same_setup(std::span<const Lora* const> clients, std::span<const double> weights) {
  POLLEN_CHECK(!clients.empty(), "LoRA aggregation: no clients");
  POLLEN_CHECK(weights.size() == clients.size(), "LoRA aggregation: ", clients.size(),
               " clients but ", weights.size(), " weights");
  const LoraConfig& c0 = clients[0]->config();
  for (size_t i = 0; i < clients.size(); ++i) {
    const LoraConfig& c = clients[i]->config();
    POLLEN_CHECK(weights[i] > 0 && std::isfinite(weights[i]), "LoRA aggregation: client ", i,
                 " has weight ", weights[i], ", expected a positive number");
    POLLEN_CHECK(c.rank == c0.rank && c.targets == c0.targets && c.scale() == c0.scale() &&
                     clients[i]->named_tensors().size() == clients[0]->named_tensors().size(),
                 "LoRA aggregation: client ", i,
                 "'s adapters differ from client 0's in rank, alpha or target modules");
  }
}

}  // namespace

const char* lora_target_name(LoraTarget target) {
  return kTargetNames[static_cast<int>(target)];
}

LoraTarget parse_lora_target(const std::string& name, const std::string& where) {
  for (int t = 0; t <= static_cast<int>(LoraTarget::lm_head); ++t)
    if (name == kTargetNames[t]) return static_cast<LoraTarget>(t);
  throw Error(where + ": unknown LoRA target module '" + name +
              "', expected q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj or "
              "lm_head");
}

double LoraConfig::scale() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

bool LoraConfig::targets_module(LoraTarget target) const {
  for (LoraTarget t : targets)
    if (t == target) return true;
  return false;
}

void LoraConfig::validate() const {
  POLLEN_CHECK(rank > 0, "LoRA: rank must be positive, got ", rank);
  // At 0 the adapters' update is scaled to nothing (B would get no gradient).
  POLLEN_CHECK(std::isfinite(alpha) && alpha > 0, "LoRA: alpha must be a positive number, got ",
               alpha);
  POLLEN_CHECK(dropout >= 0 && dropout < 1, "LoRA: dropout must be in [0, 1), got ", dropout);
  POLLEN_CHECK(!targets.empty(), "LoRA: target_modules is empty");
  for (size_t i = 0; i < targets.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      POLLEN_CHECK(targets[i] != targets[j], "LoRA: target module '", lora_target_name(targets[i]),
                   "' is listed twice");
  POLLEN_CHECK(dropout == 0 || !targets_module(LoraTarget::lm_head),
               "LoRA: dropout on lm_head is not supported (its fused cross-entropy takes the "
               "adapted weight as one matrix); set dropout = 0 or leave lm_head out");
}

LoraConfig read_lora_config(ConfigTable& table, uint64_t default_seed) {
  LoraConfig c;
  c.rank = table.get_int("rank", c.rank);
  c.alpha = table.get_double("alpha", c.alpha);
  c.dropout = table.get_double("dropout", c.dropout);
  if (table.has("target_modules")) {
    c.targets.clear();
    for (const std::string& name : table.get_strings("target_modules"))
      c.targets.push_back(parse_lora_target(name, table.where("target_modules")));
  }
  c.rslora = table.get_bool("rslora", c.rslora);
  c.train_a = table.get_bool("train_a", c.train_a);
  c.seed = static_cast<uint64_t>(
      table.get_int_in("seed", static_cast<int64_t>(default_seed), 0, kConfigIntMax));
  POLLEN_CHECK(c.rank > 0, table.where("rank"), ": expected a positive rank, got ", c.rank);
  POLLEN_CHECK(std::isfinite(c.alpha) && c.alpha > 0, table.where("alpha"),
               ": expected a positive number (the adapters' scale is alpha / rank), got ", c.alpha);
  POLLEN_CHECK(c.dropout >= 0 && c.dropout < 1, table.where("dropout"),
               ": expected a probability in [0, 1), got ", c.dropout);
  try {
    c.validate();  // what is left concerns the targets
  } catch (const Error& e) {
    throw Error(table.where("target_modules") + ": " + e.what());
  }
  return c;
}

Lora::Lora(const LlamaConfig& model, const LoraConfig& config, DType dtype)
    : Lora(model, config, TensorSource{}, dtype) {
  const Rng root = Rng(config_.seed).fork(kInitDomain);
  uint64_t stream = 0;
  for (auto& [name, v] : named_tensors()) {
    if (!name.ends_with("lora_A.weight")) continue;
    Tensor a = kaiming_uniform(v.size(0), v.size(1), root.fork(stream++), dtype_);
    std::memcpy(v.value().raw(), a.raw(), a.nbytes());
  }
}

Lora::Lora(const LlamaConfig& model, const LoraConfig& config, const TensorSource& source,
           DType dtype)
    : model_(model), config_(config), dtype_(dtype) {
  model_.validate();
  config_.validate();
  POLLEN_CHECK(!model_.tie_word_embeddings || !config_.targets_module(LoraTarget::lm_head),
               "LoRA: model '", model_.name,
               "' ties lm_head to the input embeddings; an adapter on lm_head would change both");
  layers_.resize(static_cast<size_t>(model_.num_hidden_layers));
  auto tensor = [&](const std::string& name, const Shape& shape, bool trained) {
    Tensor t;
    if (source) {
      t = source(name, shape);
      POLLEN_CHECK(t.shape() == shape && t.dtype() == dtype_ && t.is_contiguous(), "LoRA tensor '",
                   name, "' came as ", shape_str(t.shape()), " ", dtype_name(t.dtype()),
                   ", expected ", shape_str(shape), " ", dtype_name(dtype_));
    } else {
      t = Tensor::zeros(shape, dtype_);
    }
    return ag::Var(t, trained, name);
  };
  for (const Slot& s : slots(model_, config_)) {
    LoraAdapter ad;
    ad.a = tensor(s.prefix + ".lora_A.weight", {config_.rank, s.in}, config_.train_a);
    ad.b = tensor(s.prefix + ".lora_B.weight", {s.out, config_.rank}, true);
    if (s.layer < 0) {
      head_ = ad;
    } else {
      layers_[static_cast<size_t>(s.layer)][static_cast<size_t>(s.target)] = ad;
    }
  }
}

const LoraAdapter& Lora::adapter(int64_t layer, LoraTarget target) const {
  POLLEN_CHECK(layer >= 0 && layer < model_.num_hidden_layers && target != LoraTarget::lm_head,
               "Lora::adapter: no layer ", layer, " / ", lora_target_name(target));
  return layers_[static_cast<size_t>(layer)][static_cast<size_t>(target)];
}

std::vector<std::pair<std::string, ag::Var>> Lora::named_tensors() const {
  std::vector<std::pair<std::string, ag::Var>> out;
  auto add = [&](const LoraAdapter& ad) {
    if (!ad.defined()) return;
    out.emplace_back(ad.a.name(), ad.a);
    out.emplace_back(ad.b.name(), ad.b);
  };
  for (const auto& layer : layers_)
    for (const LoraAdapter& ad : layer) add(ad);
  add(head_);
  return out;
}

std::vector<std::pair<std::string, ag::Var>> Lora::named_parameters() const {
  std::vector<std::pair<std::string, ag::Var>> out;
  for (auto& [name, v] : named_tensors())
    if (v.requires_grad()) out.emplace_back(name, v);
  return out;
}

std::string Lora::base_weight_name(const std::string& adapter_name) {
  const std::string prefix = "base_model.model.";
  std::string suffix;
  for (const char* s : {".lora_A.weight", ".lora_B.weight"})
    if (adapter_name.ends_with(s)) suffix = s;
  POLLEN_CHECK(adapter_name.starts_with(prefix) && !suffix.empty(), "'", adapter_name,
               "' is not a LoRA tensor name (base_model.model.<module>.lora_A.weight or "
               ".lora_B.weight)");
  return adapter_name.substr(prefix.size(), adapter_name.size() - prefix.size() - suffix.size()) +
         ".weight";
}

void Lora::set_dropout_step(uint64_t step) {
  dropout_key_ = DropoutKey{step};
}

uint64_t Lora::next_dropout_forward() const {
  if (!dropout_key_ || config_.dropout == 0) return 0;
  return dropout_key_->forwards++;
}

void Lora::skip_dropout_forwards(uint64_t n) const {
  if (dropout_key_) dropout_key_->forwards += n;
}

Tensor Lora::dropout_mask(int64_t layer, LoraTarget target, int64_t rows, int64_t cols,
                          uint64_t forward) const {
  if (!dropout_key_ || config_.dropout == 0) return {};
  Rng rng = Rng(config_.seed)
                .fork(kDropoutDomain)
                .fork(dropout_key_->step)
                .fork(forward)
                .fork(static_cast<uint64_t>(layer) * 8 + static_cast<uint64_t>(target));
  const double keep = 1.0 / (1.0 - config_.dropout);
  Tensor mask = Tensor::empty({rows, cols}, DType::f64);
  double* p = mask.data<double>();
  for (int64_t i = 0; i < mask.numel(); ++i) p[i] = rng.uniform() < config_.dropout ? 0.0 : keep;
  return mask.to(dtype_);
}

Llama merge_lora(const Llama& base, const Lora& lora) {
  const LlamaConfig& m = base.config();
  const LlamaConfig& l = lora.model_config();
  POLLEN_CHECK(m.hidden_size == l.hidden_size && m.intermediate_size == l.intermediate_size &&
                   m.num_hidden_layers == l.num_hidden_layers &&
                   m.num_attention_heads == l.num_attention_heads &&
                   m.num_key_value_heads == l.num_key_value_heads &&
                   m.resolved_head_dim() == l.resolved_head_dim() && m.vocab_size == l.vocab_size,
               "LoRA merge: the adapters were made for a model of another shape than '", m.name,
               "'");
  std::map<std::string, Tensor> merged;
  for (auto& [name, v] : base.named_parameters()) merged[name] = v.value().clone();
  const auto tensors = lora.named_tensors();
  for (size_t i = 0; i + 1 < tensors.size(); i += 2) {
    const ag::Var& a = tensors[i].second;
    const ag::Var& b = tensors[i + 1].second;
    auto it = merged.find(Lora::base_weight_name(a.name()));
    POLLEN_CHECK(it != merged.end(), "LoRA merge: the base has no weight '",
                 Lora::base_weight_name(a.name()), "' for adapter '", a.name(), "'");
    Tensor& w = it->second;
    POLLEN_CHECK(w.dtype() == a.dtype(), "LoRA merge: adapter '", a.name(), "' is ",
                 dtype_name(a.dtype()), " but the base is ", dtype_name(w.dtype()));
    ops::gemm(b.value(), false, a.value(), false, w, lora.scale(), 1.0);  // W += scale B A
  }
  return Llama(
      m, [&](const std::string& name, const Shape&) { return merged.at(name); }, base.dtype());
}

Lora average_lora_shared_a(std::span<const Lora* const> clients, std::span<const double> weights) {
  check_same_setup(clients, weights);
  double total = 0;
  for (double w : weights) total += w;
  const Lora& first = *clients[0];
  std::vector<std::vector<std::pair<std::string, ag::Var>>> each;
  for (const Lora* c : clients) each.push_back(c->named_tensors());
  std::map<std::string, Tensor> out;
  for (size_t t = 0; t < each[0].size(); ++t) {
    const std::string& name = each[0][t].first;
    const Tensor& v0 = each[0][t].second.value();
    if (name.ends_with("lora_A.weight")) {
      for (size_t i = 1; i < clients.size(); ++i) {
        const Tensor& vi = each[i][t].second.value();
        POLLEN_CHECK(each[i][t].first == name && vi.shape() == v0.shape() &&
                         std::memcmp(vi.raw(), v0.raw(), v0.nbytes()) == 0,
                     "LoRA aggregation with A shared: client ", i, "'s '", name,
                     "' differs from client 0's; A must come from the same seed and stay frozen "
                     "(train_a = false)");
      }
      out[name] = v0.clone();
      continue;
    }
    Tensor sum = Tensor::zeros(v0.shape(), DType::f64);  // sum_i w_i B_i / sum_i w_i
    for (size_t i = 0; i < clients.size(); ++i)
      ops::axpy(weights[i] / total, each[i][t].second.value().to(DType::f64), sum);
    out[name] = sum.to(first.dtype());
  }
  return Lora(
      first.model_config(), first.config(),
      [&](const std::string& name, const Shape&) { return out.at(name); }, first.dtype());
}

std::vector<std::pair<std::string, Tensor>> average_merged_updates(
    std::span<const Lora* const> clients, std::span<const double> weights) {
  check_same_setup(clients, weights);
  double total = 0;
  for (double w : weights) total += w;
  std::vector<std::vector<std::pair<std::string, ag::Var>>> each;
  for (const Lora* c : clients) each.push_back(c->named_tensors());
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t t = 0; t + 1 < each[0].size(); t += 2) {
    const int64_t rows = each[0][t + 1].second.size(0), cols = each[0][t].second.size(1);
    Tensor sum = Tensor::zeros({rows, cols}, DType::f64);  // sum_i w_i scale B_i A_i / sum w
    for (size_t i = 0; i < clients.size(); ++i) {
      const Tensor a = each[i][t].second.value().to(DType::f64);
      const Tensor b = each[i][t + 1].second.value().to(DType::f64);
      ops::gemm(b, false, a, false, sum, clients[i]->scale() * weights[i] / total, 1.0);
    }
    out.emplace_back(Lora::base_weight_name(each[0][t].first), sum.to(clients[0]->dtype()));
  }
  return out;
}

}  // namespace pollen::model
