#include "io/hf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "io/safetensors.h"
#include "tensor/compare.h"

namespace pollen::io {
namespace fs = std::filesystem;
namespace {

using json = nlohmann::json;

// Reads config.json's keys one at a time and remembers which were read, so that any key left
// over is refused by name.
class KeyReader {
 public:
  KeyReader(const json& j, std::string source) : j_(j), source_(std::move(source)) {
    POLLEN_CHECK(j_.is_object(), source_, ": expected a JSON object");
  }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  const json& raw(const std::string& key) {
    read_.insert(key);
    return j_[key];
  }
  int64_t get_int(const std::string& key, std::optional<int64_t> fallback = std::nullopt) {
    read_.insert(key);
    if (!has(key)) {
      POLLEN_CHECK(fallback.has_value(), source_, ": key '", key, "' is required");
      return *fallback;
    }
    POLLEN_CHECK(j_[key].is_number_integer(), source_, ": key '", key, "' must be an integer, got ",
                 j_[key].dump());
    return j_[key].get<int64_t>();
  }
  double get_double(const std::string& key, double fallback) {
    read_.insert(key);
    if (!has(key)) return fallback;
    POLLEN_CHECK(j_[key].is_number(), source_, ": key '", key, "' must be a number, got ",
                 j_[key].dump());
    return j_[key].get<double>();
  }
  bool get_bool(const std::string& key, bool fallback) {
    read_.insert(key);
    if (!has(key)) return fallback;
    POLLEN_CHECK(j_[key].is_boolean(), source_, ": key '", key, "' must be true or false, got ",
                 j_[key].dump());
    return j_[key].get<bool>();
  }
  std::string get_string(const std::string& key, const std::string& fallback) {
    read_.insert(key);
    if (!has(key)) return fallback;
    POLLEN_CHECK(j_[key].is_string(), source_, ": key '", key, "' must be a string, got ",
                 j_[key].dump());
    return j_[key].get<std::string>();
  }
  void ignore(const std::string& key) { read_.insert(key); }
  void finish(const std::string& what) const {
    for (const auto& [key, value] : j_.items()) {
      POLLEN_CHECK(read_.count(key), source_, ": key '", key, "'", what);
    }
  }
  const std::string& source() const { return source_; }

 private:
  const json& j_;
  std::string source_;
  std::set<std::string> read_;
};

ops::RopeScaling parse_rope_scaling(const json& j, int64_t max_position_embeddings,
                                    const std::string& source) {
  ops::RopeScaling s;
  if (j.is_null()) return s;
  const std::string where = source + ", rope_scaling";
  KeyReader r(j, where);
  std::string type = r.get_string("rope_type", "");
  const std::string legacy = r.get_string("type", "");
  if (type.empty()) type = legacy;
  POLLEN_CHECK(!type.empty(), where, ": needs 'rope_type' (or 'type')");
  if (type == "default") {
    r.finish(" is not understood for rope_type 'default'");
    return s;
  }
  if (type == "linear") {
    s.kind = ops::RopeScaling::Kind::linear;
    s.factor = r.get_double("factor", 0);
    POLLEN_CHECK(s.factor > 0, where, ": 'factor' must be positive");
    r.finish(" is not understood for rope_type 'linear'");
    return s;
  }
  if (type == "llama3") {
    s.kind = ops::RopeScaling::Kind::llama3;
    s.factor = r.get_double("factor", 0);
    s.low_freq_factor = r.get_double("low_freq_factor", 0);
    s.high_freq_factor = r.get_double("high_freq_factor", 0);
    s.original_max_position_embeddings = r.get_int("original_max_position_embeddings");
    POLLEN_CHECK(s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
                 where, ": llama3 needs factor > 0 and 0 < low_freq_factor < high_freq_factor");
    r.finish(" is not understood for rope_type 'llama3'");
    return s;
  }
  if (type == "dynamic" || type == "yarn") {
    // transformers 4.44 measures both against max_position_embeddings; a different
    // original_max_position_embeddings (which later releases read) would be ambiguous.
    s.original_max_position_embeddings = max_position_embeddings;
    const int64_t original = r.get_int("original_max_position_embeddings", max_position_embeddings);
    POLLEN_CHECK(original == max_position_embeddings, where,
                 ": 'original_max_position_embeddings' (", original,
                 ") differs from max_position_embeddings (", max_position_embeddings,
                 "); transformers 4.44, which pollen follows, scales from max_position_embeddings");
    s.factor = r.get_double("factor", 0);
    POLLEN_CHECK(s.factor >= 1, where, ": 'factor' must be >= 1 for rope_type '", type, "'");
  }
  if (type == "dynamic") {
    s.kind = ops::RopeScaling::Kind::dynamic;
    r.finish(" is not understood for rope_type 'dynamic'");
    return s;
  }
  if (type == "yarn") {
    s.kind = ops::RopeScaling::Kind::yarn;
    // HF takes a missing (or zero) beta as its default, and attention_factor from the factor.
    s.beta_fast = r.get_double("beta_fast", 0);
    s.beta_slow = r.get_double("beta_slow", 0);
    if (s.beta_fast == 0) s.beta_fast = 32;
    if (s.beta_slow == 0) s.beta_slow = 1;
    s.attention_factor = r.get_double("attention_factor", 0.1 * std::log(s.factor) + 1.0);
    POLLEN_CHECK(s.attention_factor > 0 && s.beta_fast > s.beta_slow && s.beta_slow > 0, where,
                 ": yarn needs attention_factor > 0 and beta_fast > beta_slow > 0");
    r.finish(" is not understood for rope_type 'yarn'");
    return s;
  }
  fail(where, ": rope_type '", type,
       "' is not implemented by pollen (implemented: default, linear, llama3, dynamic, yarn)");
}

}  // namespace

const std::vector<std::string>& hf_ignored_config_keys() {
  // "dtype": torch_dtype as transformers >= 4.56 names it.
  static const std::vector<std::string> keys = {
      "_name_or_path",        "architectures",       "transformers_version",
      "torch_dtype",          "bos_token_id",        "eos_token_id",
      "pad_token_id",         "use_cache",           "initializer_range",
      "pretraining_tp",       "return_dict",         "output_attentions",
      "output_hidden_states", "tokenizer_class",     "auto_map",
      "name_or_path",         "attn_implementation", "dtype",
      "_attn_implementation",  // a kernel choice, same arithmetic
      "max_window_layers",     // Qwen2: used only with use_sliding_window, which is refused
  };
  return keys;
}

namespace {

// transformers 4.44's defaults for keys a config.json may leave out (LlamaConfig, MistralConfig,
// Qwen2Config): they differ by type.
struct HfDefaults {
  int64_t num_key_value_heads;
  int64_t max_position_embeddings;
  int64_t sliding_window;  // mistral only
};

HfDefaults hf_defaults(const std::string& type, int64_t num_attention_heads) {
  if (type == "mistral") return {8, 4096 * 32, 4096};
  if (type == "qwen2") return {32, 32768, 0};
  return {num_attention_heads, 2048, 0};
}

// A tied model's file may hold lm_head.weight beside the embedding, as transformers saves it; a
// copy that differs would give other logits than transformers (which takes it for both), so it
// must be the embedding, bit for bit once widened to float32.
void check_tied_copy(const Tensor& head, const Tensor& embedding, const fs::path& file) {
  POLLEN_CHECK(head.shape() == embedding.shape(), "'", file.string(),
               "': tensor 'lm_head.weight' has shape ", shape_str(head.shape()),
               "; config.json ties it to model.embed_tokens.weight of shape ",
               shape_str(embedding.shape()));
  const int64_t i = first_difference_as_f32(head, embedding);
  POLLEN_CHECK(i < 0, "'", file.string(),
               "': tensor 'lm_head.weight' differs from model.embed_tokens.weight (first at "
               "element ",
               i,
               ") although config.json ties them (tie_word_embeddings); set "
               "tie_word_embeddings to false to load both, or save the model again");
}

}  // namespace

model::LlamaConfig parse_hf_config(const json& j, const std::string& source) {
  KeyReader r(j, source);
  for (const auto& k : hf_ignored_config_keys()) r.ignore(k);
  model::LlamaConfig c;
  const std::string type = r.get_string("model_type", "");
  POLLEN_CHECK(type == "llama" || type == "mistral" || type == "qwen2", source, ": model_type '",
               type, "' is not supported (supported: llama, mistral, qwen2)");
  c.name = r.get_string("_name_or_path", "");
  if (c.name.empty()) c.name = type;
  c.vocab_size = r.get_int("vocab_size");
  c.hidden_size = r.get_int("hidden_size");
  c.intermediate_size = r.get_int("intermediate_size");
  c.num_hidden_layers = r.get_int("num_hidden_layers");
  c.num_attention_heads = r.get_int("num_attention_heads");
  // A key left out means what transformers' config class of the type defaults it to.
  const HfDefaults defaults = hf_defaults(type, c.num_attention_heads);
  // null, as transformers reads it for all three types: as many as the attention heads.
  if (j.contains("num_key_value_heads") && r.raw("num_key_value_heads").is_null())
    c.num_key_value_heads = c.num_attention_heads;
  else
    c.num_key_value_heads = r.get_int("num_key_value_heads", defaults.num_key_value_heads);
  c.head_dim = r.get_int("head_dim", 0);
  c.max_position_embeddings =
      r.get_int("max_position_embeddings", defaults.max_position_embeddings);
  c.rope_theta = r.get_double("rope_theta", 10000.0);
  c.rms_norm_eps = r.get_double("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  if (j.contains("initializer_range") && j["initializer_range"].is_number())
    c.initializer_range = j["initializer_range"].get<double>();
  const std::string act = r.get_string("hidden_act", "silu");
  POLLEN_CHECK(act == "silu", source, ": key 'hidden_act' is '", act,
               "'; pollen implements only 'silu' (SwiGLU)");
  POLLEN_CHECK(!r.get_bool("mlp_bias", false), source,
               ": key 'mlp_bias' is true; pollen's MLP has no biases");
  POLLEN_CHECK(r.get_double("attention_dropout", 0.0) == 0.0, source,
               ": key 'attention_dropout' is not 0; pollen has no dropout");
  if (type == "qwen2") {
    c.attention_bias = true;  // Qwen2 always biases q, k and v (and not o)
    POLLEN_CHECK(!r.get_bool("use_sliding_window", false), source,
                 ": key 'use_sliding_window' is true; pollen does not implement Qwen2's ",
                 "per-layer sliding window");
    r.ignore("sliding_window");  // used only with use_sliding_window
  } else {
    POLLEN_CHECK(!r.get_bool("attention_bias", false), source,
                 ": key 'attention_bias' is true for ", "model_type '", type,
                 "', which biases o_proj too; pollen implements q/k/v ",
                 "biases only (model_type qwen2)");
  }
  if (type == "mistral") {
    // null: no window (Mistral 7B v0.2 on); left out: MistralConfig's 4096
    if (!j.contains("sliding_window"))
      c.sliding_window = defaults.sliding_window;
    else if (r.has("sliding_window"))
      c.sliding_window = r.get_int("sliding_window");
    r.ignore("sliding_window");
  } else if (type == "llama") {
    POLLEN_CHECK(!r.has("sliding_window"), source,
                 ": key 'sliding_window' is not used by model_type llama");
    r.ignore("sliding_window");
  }
  // Keys of the official SmolLM2 and Qwen2.5 configs that name the computation pollen does:
  // rotate_half rotary (not interleaved) and plain RoPE (not Qwen2-VL's multimodal one).
  POLLEN_CHECK(!r.get_bool("rope_interleaved", false), source,
               ": key 'rope_interleaved' is true; pollen rotates half-vectors as HF's Llama does");
  POLLEN_CHECK(!r.get_bool("use_mrope", false), source,
               ": key 'use_mrope' is true; pollen does not implement multimodal RoPE");
  r.ignore("is_llama_config");
  if (r.has("rope_scaling"))
    c.rope_scaling = parse_rope_scaling(r.raw("rope_scaling"), c.max_position_embeddings, source);
  r.ignore("rope_scaling");  // absent or null: no scaling
  // transformers >= 4.56 lists each layer's attention; pollen's are all full (sliding windows are
  // the model-wide sliding_window above).
  if (r.has("layer_types")) {
    const json& types = r.raw("layer_types");
    POLLEN_CHECK(types.is_array(), source, ": key 'layer_types' must be a list, got ",
                 types.dump());
    for (const auto& t : types)
      POLLEN_CHECK(t == "full_attention", source, ": key 'layer_types' holds ", t.dump(),
                   "; pollen implements only 'full_attention' layers");
  }
  r.ignore("layer_types");
  r.finish(
      " is not understood by pollen (it may change the computation, so it is refused "
      "rather than ignored)");
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
  return c;
}

model::LlamaConfig read_hf_config(const fs::path& config_json) {
  json j;
  const std::string text = read_file(config_json);
  check_json_depth(text, cat("'", config_json.string(), "'"));
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("'", config_json.string(), "' is not valid JSON: ", e.what());
  }
  return parse_hf_config(j, "'" + config_json.string() + "'");
}

nlohmann::ordered_json hf_config_json(const model::LlamaConfig& c, const std::string& torch_dtype) {
  nlohmann::ordered_json j;
  std::string type = "llama", arch = "LlamaForCausalLM";
  POLLEN_CHECK(!(c.attention_bias && c.sliding_window > 0),
               "export: a model with both q/k/v biases and a sliding window has no HF type");
  if (c.attention_bias) type = "qwen2", arch = "Qwen2ForCausalLM";
  if (c.sliding_window > 0) type = "mistral", arch = "MistralForCausalLM";
  j["architectures"] = {arch};
  j["model_type"] = type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  if (c.head_dim > 0 && c.head_dim != c.hidden_size / c.num_attention_heads) {
    POLLEN_CHECK(type != "qwen2", "export: qwen2 configs cannot carry head_dim");
    j["head_dim"] = c.head_dim;
  }
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rope_theta"] = c.rope_theta;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["initializer_range"] = c.initializer_range;
  if (type == "llama") {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  }
  if (type == "mistral") j["sliding_window"] = c.sliding_window;
  const auto& s = c.rope_scaling;
  switch (s.kind) {
    case ops::RopeScaling::Kind::none:
      j["rope_scaling"] = nullptr;
      break;
    case ops::RopeScaling::Kind::linear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", s.factor}};
      break;
    case ops::RopeScaling::Kind::llama3:
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", s.original_max_position_embeddings}};
      break;
    case ops::RopeScaling::Kind::dynamic:
      j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", s.factor}};
      break;
    case ops::RopeScaling::Kind::yarn:
      j["rope_scaling"] = {{"rope_type", "yarn"},
                           {"factor", s.factor},
                           {"attention_factor", s.attention_factor},
                           {"beta_fast", s.beta_fast},
                           {"beta_slow", s.beta_slow}};
      break;
  }
  j["torch_dtype"] = torch_dtype;
  return j;
}

bool is_hf_dir(const fs::path& dir) {
  return fs::is_regular_file(dir / "config.json") &&
         (fs::is_regular_file(dir / "model.safetensors") ||
          fs::is_regular_file(dir / "model.safetensors.index.json"));
}

model::Llama load_hf_model(const fs::path& dir, DType dtype) {
  const model::LlamaConfig config = read_hf_config(dir / "config.json");
  // Which file holds each tensor.
  std::vector<fs::path> files;
  std::map<std::string, size_t> file_of;
  if (fs::is_regular_file(dir / "model.safetensors")) {
    files.push_back(dir / "model.safetensors");
  } else {
    const fs::path index_path = dir / "model.safetensors.index.json";
    json index;
    const std::string text = read_file(index_path);
    check_json_depth(text, cat("'", index_path.string(), "'"));
    try {
      index = json::parse(text);
    } catch (const json::exception& e) {
      fail("'", index_path.string(), "' is not valid JSON: ", e.what());
    }
    POLLEN_CHECK(
        index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), "'",
        index_path.string(), "': expected an object with 'weight_map'");
    std::map<std::string, size_t> file_ids;
    for (const auto& [name, file] : index["weight_map"].items()) {
      POLLEN_CHECK(file.is_string(), "'", index_path.string(), "': weight_map['", name,
                   "'] must be a file name");
      const std::string f = file.get<std::string>();
      POLLEN_CHECK(f.find('/') == std::string::npos && f != "." && f != ".." && !f.empty(), "'",
                   index_path.string(), "': weight_map['", name, "'] = '", f,
                   "' must be a file in the same folder");
      auto [it, added] = file_ids.emplace(f, files.size());
      if (added) files.push_back(dir / f);
      file_of[name] = it->second;
    }
  }
  // Every file is mapped and parsed once; tensors are converted to `dtype` as they are taken.
  std::map<std::string, std::pair<size_t, Tensor>> tensors;
  for (size_t i = 0; i < files.size(); ++i) {
    SafetensorsFile f = read_safetensors(files[i]);
    for (auto& [name, t] : f.tensors) {
      if (!file_of.empty()) {
        const auto it = file_of.find(name);
        POLLEN_CHECK(it != file_of.end() && it->second == i, "'", files[i].string(), "': tensor '",
                     name, "' is not listed for this file in the index");
      }
      POLLEN_CHECK(!tensors.count(name), "'", dir.string(), "': tensor '", name, "' appears twice");
      tensors.emplace(name, std::make_pair(i, std::move(t)));
    }
  }
  for (const auto& [name, i] : file_of) {
    POLLEN_CHECK(tensors.count(name), "'", files[i].string(), "' lacks tensor '", name,
                 "' that the index lists");
  }
  std::set<std::string> used;
  model::Llama m(
      config,
      [&](const std::string& name, const Shape& shape) {
        const auto it = tensors.find(name);
        POLLEN_CHECK(it != tensors.end(), "'", dir.string(), "': no tensor '", name, "'");
        const Tensor& t = it->second.second;
        POLLEN_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16 ||
                         t.dtype() == DType::f16 || t.dtype() == DType::f64,
                     "'", files[it->second.first].string(), "': tensor '", name, "' has dtype ",
                     dtype_name(t.dtype()), "; expected F64, F32, BF16 or F16");
        POLLEN_CHECK(t.shape() == shape, "'", files[it->second.first].string(), "': tensor '", name,
                     "' has shape ", shape_str(t.shape()), ", config.json implies ",
                     shape_str(shape));
        used.insert(name);
        return t.dtype() == dtype ? t : t.to(dtype);
      },
      dtype);
  for (const auto& [name, entry] : tensors) {
    if (used.count(name)) continue;
    if (name == "lm_head.weight" && config.tie_word_embeddings) {
      check_tied_copy(entry.second, tensors.at("model.embed_tokens.weight").second,
                      files[entry.first]);
      continue;
    }
    if (name.ends_with("rotary_emb.inv_freq")) continue;  // a buffer older transformers saved
    fail("'", files[entry.first].string(), "': tensor '", name,
         "' is not a parameter of this model (config.json describes none such)");
  }
  return m;
}

nlohmann::json hf_tokenizer_config(int64_t context) {
  return {{"tokenizer_class", "PreTrainedTokenizerFast"},
          {"model_input_names", {"input_ids", "attention_mask"}},
          {"model_max_length", context}};
}

}  // namespace pollen::io
