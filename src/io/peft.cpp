#include "io/peft.h"

#include <set>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "io/safetensors.h"
#include "model/llama.h"
#include "tensor/compare.h"

namespace pollen::io {
namespace fs = std::filesystem;
namespace {

std::string join_targets(const std::vector<model::LoraTarget>& targets) {
  std::string out;
  for (model::LoraTarget t : targets)
    out += (out.empty() ? "" : ", ") + std::string(lora_target_name(t));
  return "[" + out + "]";
}

// A key that must be absent, null, false, empty or equal to `allowed` (what pollen implements).
void expect_unused(const nlohmann::json& j, const std::string& key, const std::string& source,
                   const std::string& what) {
  if (!j.contains(key)) return;
  const auto& v = j[key];
  const bool unused = v.is_null() || (v.is_boolean() && !v.get<bool>()) ||
                      ((v.is_object() || v.is_array()) && v.empty());
  POLLEN_CHECK(unused, "'", source, "': key '", key, "' is ", v.dump(),
               "; pollen does not implement ", what);
}

// PEFT's copy of the base's head (save_embedding_layers, for adapters that target lm_head).
constexpr const char* kSavedHead = "base_model.model.lm_head.base_layer.weight";

// Takes the copy when it is the base's head (the embedding, in a tied model) bit for bit.
void check_saved_head(const Tensor& copy, const model::Llama* base, const fs::path& file) {
  POLLEN_CHECK(base != nullptr, "'", file.string(), "': tensor '", kSavedHead,
               "' is a copy of a base's head, which this command cannot compare with its base");
  const char* head =
      base->config().tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  for (const auto& [name, v] : base->named_parameters()) {
    if (name != head) continue;
    POLLEN_CHECK(copy.shape() == v.value().shape(), "'", file.string(), "': tensor '", kSavedHead,
                 "' has shape ", shape_str(copy.shape()), ", the base's ", head, " ",
                 shape_str(v.value().shape()));
    const int64_t i = first_difference_as_f32(copy, v.value());
    POLLEN_CHECK(i < 0, "'", file.string(), "': tensor '", kSavedHead,
                 "' (PEFT's copy of the base's head) differs from the base's ", head,
                 " (first at element ", i,
                 "): the adapters were saved on another base, whose head PEFT would load");
    return;
  }
  fail("'", file.string(), "': the base has no ", head, " to compare '", kSavedHead, "' with");
}

}  // namespace

nlohmann::ordered_json peft_config_json(const model::LoraConfig& config,
                                        const std::string& base_model) {
  nlohmann::ordered_json j;
  nlohmann::ordered_json targets = nlohmann::ordered_json::array();
  for (model::LoraTarget t : config.targets) targets.push_back(lora_target_name(t));
  j["alpha_pattern"] = nlohmann::ordered_json::object();
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] = base_model;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layer_replication"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["lora_alpha"] = config.alpha;
  j["lora_dropout"] = config.dropout;
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["r"] = config.rank;
  j["rank_pattern"] = nlohmann::ordered_json::object();
  j["revision"] = nullptr;
  j["target_modules"] = targets;
  j["task_type"] = "CAUSAL_LM";
  j["use_dora"] = false;
  j["use_rslora"] = config.rslora;
  return j;
}

void save_peft_adapter(const model::Lora& lora, const fs::path& dir,
                       const std::string& base_model) {
  fs::create_directories(dir);
  NamedTensors tensors;
  for (const auto& [name, v] : lora.named_tensors()) tensors.emplace_back(name, v.value());
  write_safetensors_atomic(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(dir / "adapter_config.json",
                    peft_config_json(lora.config(), base_model).dump(2) + "\n");
}

model::LoraConfig read_peft_config(const fs::path& config_json) {
  const std::string source = config_json.string();
  const std::string text = read_file(config_json);
  check_json_depth(text, cat("'", source, "'"));
  const auto j = nlohmann::json::parse(text, nullptr, false);
  POLLEN_CHECK(!j.is_discarded() && j.is_object(), "'", source, "' is not a JSON object");
  auto need = [&](const std::string& key) -> const nlohmann::json& {
    POLLEN_CHECK(j.contains(key), "'", source, "' has no key '", key, "'");
    return j[key];
  };
  POLLEN_CHECK(need("peft_type").is_string() && j["peft_type"] == "LORA", "'", source,
               "': peft_type is ", j["peft_type"].dump(), ", expected \"LORA\"");
  model::LoraConfig c;
  POLLEN_CHECK(need("r").is_number_integer() && j["r"].get<int64_t>() > 0, "'", source, "': r is ",
               j["r"].dump(), ", expected a positive integer");
  c.rank = j["r"].get<int64_t>();
  POLLEN_CHECK(need("lora_alpha").is_number(), "'", source, "': lora_alpha is ",
               j["lora_alpha"].dump(), ", expected a number");
  c.alpha = j["lora_alpha"].get<double>();
  if (j.contains("lora_dropout")) {
    POLLEN_CHECK(j["lora_dropout"].is_number(), "'", source, "': lora_dropout is ",
                 j["lora_dropout"].dump(), ", expected a number");
    c.dropout = j["lora_dropout"].get<double>();
  }
  if (j.contains("use_rslora")) {
    POLLEN_CHECK(j["use_rslora"].is_boolean(), "'", source, "': use_rslora is ",
                 j["use_rslora"].dump(), ", expected true or false");
    c.rslora = j["use_rslora"].get<bool>();
  }
  const auto& targets = need("target_modules");
  POLLEN_CHECK(targets.is_array(), "'", source, "': target_modules is ", targets.dump(),
               ", expected a list of module names (pollen does not match regular expressions)");
  c.targets.clear();
  for (const auto& t : targets) {
    POLLEN_CHECK(t.is_string(), "'", source, "': target_modules holds ", t.dump(),
                 ", expected module names");
    c.targets.push_back(
        model::parse_lora_target(t.get<std::string>(), "'" + source + "': target_modules"));
  }
  if (j.contains("bias"))
    POLLEN_CHECK(j["bias"] == "none", "'", source, "': bias is ", j["bias"].dump(),
                 ", pollen implements only \"none\"");
  if (j.contains("task_type") && !j["task_type"].is_null())
    POLLEN_CHECK(j["task_type"] == "CAUSAL_LM", "'", source, "': task_type is ",
                 j["task_type"].dump(), ", expected \"CAUSAL_LM\"");
  expect_unused(j, "use_dora", source, "DoRA");
  expect_unused(j, "fan_in_fan_out", source, "transposed (Conv1D) weights");
  expect_unused(j, "lora_bias", source, "biases on lora_B");
  expect_unused(j, "layers_to_transform", source, "adapters on some layers only");
  expect_unused(j, "layers_pattern", source, "adapters on some layers only");
  expect_unused(j, "rank_pattern", source, "per-module ranks");
  expect_unused(j, "alpha_pattern", source, "per-module alphas");
  expect_unused(j, "modules_to_save", source, "fully trained extra modules");
  expect_unused(j, "layer_replication", source, "layer replication");
  expect_unused(j, "exclude_modules", source, "modules left out of target_modules");
  expect_unused(j, "target_parameters", source, "adapters on parameters");
  expect_unused(j, "trainable_token_indices", source, "trained rows of the embedding");
  expect_unused(j, "alora_invocation_tokens", source,
                "activated LoRA (an adapter applied after its invocation tokens only)");
  expect_unused(j, "arrow_config", source, "Arrow routing between adapters");
  expect_unused(j, "use_qalora", source, "QA-LoRA's pooled inputs");
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error("'" + source + "': " + e.what());
  }
  return c;
}

std::shared_ptr<model::Lora> load_peft_adapter(const fs::path& dir, const model::LlamaConfig& base,
                                               DType dtype, bool train_a,
                                               const model::Llama* base_weights) {
  model::LoraConfig config = read_peft_config(dir / "adapter_config.json");
  config.train_a = train_a;
  const fs::path file = dir / "adapter_model.safetensors";
  const SafetensorsFile f = read_safetensors(file);
  std::set<std::string> used;
  auto lora = std::make_shared<model::Lora>(
      base, config,
      [&](const std::string& name, const Shape& shape) {
        const Tensor* t = f.find(name);
        POLLEN_CHECK(t != nullptr, "'", file.string(), "' has no tensor '", name,
                     "' (adapter_config.json targets ", join_targets(config.targets), ")");
        const bool is_a = name.ends_with("lora_A.weight");
        const int64_t rank_dim = is_a ? 0 : 1;
        POLLEN_CHECK(t->dim() != 2 || t->shape() == shape || t->size(rank_dim) == shape[rank_dim],
                     "'", file.string(), "': tensor '", name, "' has rank ", t->size(rank_dim),
                     " but adapter_config.json says r = ", config.rank);
        POLLEN_CHECK(t->shape() == shape, "'", file.string(), "': tensor '", name, "' is ",
                     shape_str(t->shape()), ", the base model '", base.name, "' needs ",
                     shape_str(shape));
        POLLEN_CHECK(dtype_is_float(t->dtype()), "'", file.string(), "': tensor '", name,
                     "' has dtype ", dtype_name(t->dtype()), "; adapters are floating point");
        used.insert(name);
        return t->dtype() == dtype ? *t : t->to(dtype);
      },
      dtype);
  for (const auto& [name, t] : f.tensors) {
    if (used.count(name)) continue;
    if (name == kSavedHead) {
      check_saved_head(t, base_weights, file);
      continue;
    }
    fail("'", file.string(), "': tensor '", name, "' is not an adapter of target_modules ",
         join_targets(config.targets), " on a model of ", base.num_hidden_layers, " layers");
  }
  return lora;
}

}  // namespace pollen::io
