#include "model/config.h"

#include <cmath>
#include <set>
#include <type_traits>

#include "base/config.h"
#include "base/error.h"
#include "base/log.h"

namespace pollen::model {
namespace {
LlamaConfig make(const char* name, int64_t layers, int64_t hidden, int64_t heads, int64_t kv,
                 int64_t ffn, int64_t vocab, bool tied) {
  LlamaConfig c;
  c.name = name;
  c.num_hidden_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv;
  c.intermediate_size = ffn;
  c.vocab_size = vocab;
  c.tie_word_embeddings = tied;
  return c;
}
}  // namespace

std::vector<std::string> preset_names() {
  return {"llama-tiny", "llama-cpu", "llama-124m", "llama-1b", "smollm2-135m"};
}

LlamaConfig preset(const std::string& name) {
  if (name == "llama-tiny") return make("llama-tiny", 4, 256, 4, 4, 688, 4096, false);
  if (name == "llama-cpu") return make("llama-cpu", 6, 384, 6, 2, 1024, 8192, false);
  if (name == "llama-124m") return make("llama-124m", 12, 768, 12, 4, 2048, 32768, false);
  if (name == "llama-1b") return make("llama-1b", 16, 2048, 16, 8, 5632, 32768, false);
  if (name == "smollm2-135m") {
    LlamaConfig c = make("smollm2-135m", 30, 576, 9, 3, 1536, 49152, true);
    c.rope_theta = 100000.0;
    c.max_position_embeddings = 8192;
    return c;
  }
  std::string list;
  for (const auto& n : preset_names()) list += (list.empty() ? "" : ", ") + n;
  fail("unknown model preset '", name, "': expected one of ", list, ", or a .toml model file");
}

void LlamaConfig::validate() const {
  // Bounds far above any Llama-family model, so that no product of sizes overflows.
  auto in_range = [&](const char* key, int64_t v, int log2_max) {
    POLLEN_CHECK(v > 0 && v <= (int64_t{1} << log2_max), "model '", name, "': ", key,
                 " must be 1 to 2^", log2_max, ", got ", v);
  };
  in_range("vocab_size", vocab_size, 24);
  in_range("hidden_size", hidden_size, 20);
  in_range("intermediate_size", intermediate_size, 22);
  in_range("num_hidden_layers", num_hidden_layers, 16);
  in_range("num_attention_heads", num_attention_heads, 16);
  in_range("num_key_value_heads", num_key_value_heads, 16);
  in_range("max_position_embeddings", max_position_embeddings, 24);
  POLLEN_CHECK(head_dim >= 0 && head_dim <= (int64_t{1} << 16), "model '", name,
               "': head_dim must be 1 to 2^16 (or 0: hidden_size / num_attention_heads), got ",
               head_dim);
  POLLEN_CHECK(num_attention_heads % num_key_value_heads == 0, "model '", name,
               "': num_attention_heads (", num_attention_heads,
               ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  POLLEN_CHECK(head_dim > 0 || hidden_size % num_attention_heads == 0, "model '", name,
               "': hidden_size (", hidden_size, ") is not a multiple of num_attention_heads (",
               num_attention_heads, "); set head_dim");
  POLLEN_CHECK(resolved_head_dim() % 2 == 0, "model '", name, "': head_dim must be even for ",
               "rotary embeddings, got ", resolved_head_dim());
  POLLEN_CHECK(rope_theta > 0, "model '", name, "': rope_theta must be positive");
  POLLEN_CHECK(rms_norm_eps > 0, "model '", name, "': rms_norm_eps must be positive");
  POLLEN_CHECK(sliding_window >= 0, "model '", name, "': sliding_window must be >= 0");
  if (rope_scaling.kind != ops::RopeScaling::Kind::none) {
    POLLEN_CHECK(rope_scaling.factor > 0, "model '", name,
                 "': rope_scaling.factor must be positive");
  }
  if (rope_scaling.kind == ops::RopeScaling::Kind::llama3) {
    POLLEN_CHECK(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor &&
                     rope_scaling.low_freq_factor > 0 &&
                     rope_scaling.original_max_position_embeddings > 0,
                 "model '", name, "': rope_scaling (llama3) needs 0 < low_freq_factor < ",
                 "high_freq_factor and a positive original_max_position_embeddings");
  }
  if (rope_scaling.kind == ops::RopeScaling::Kind::dynamic ||
      rope_scaling.kind == ops::RopeScaling::Kind::yarn) {
    POLLEN_CHECK(rope_scaling.original_max_position_embeddings == max_position_embeddings,
                 "model '", name, "': dynamic and yarn rope_scaling scale from ",
                 "max_position_embeddings (", max_position_embeddings, "), not from ",
                 rope_scaling.original_max_position_embeddings);
  }
}

int64_t LlamaConfig::embedding_parameter_count() const {
  return vocab_size * hidden_size;
}

int64_t LlamaConfig::parameter_count() const {
  const int64_t d = resolved_head_dim(), h = hidden_size;
  const int64_t q = num_attention_heads * d, kv = num_key_value_heads * d;
  int64_t attn = h * q + 2 * h * kv + q * h + (attention_bias ? q + 2 * kv : 0);
  int64_t mlp = 3 * h * intermediate_size;
  int64_t per_layer = attn + mlp + 2 * h;
  int64_t total = num_hidden_layers * per_layer + h + embedding_parameter_count();
  if (!tie_word_embeddings) total += vocab_size * h;
  return total;
}

double LlamaConfig::flops_per_token(int64_t seq_len) const {
  const double non_embedding =
      static_cast<double>(parameter_count() - embedding_parameter_count() -
                          (tie_word_embeddings ? 0 : vocab_size * hidden_size));
  const double head = static_cast<double>(vocab_size * hidden_size);
  return 6.0 * (non_embedding + head) +
         12.0 * static_cast<double>(num_hidden_layers * hidden_size * seq_len);
}

const char* rope_scaling_kind_name(ops::RopeScaling::Kind kind) {
  using Kind = ops::RopeScaling::Kind;
  switch (kind) {
    case Kind::linear:
      return "linear";
    case Kind::llama3:
      return "llama3";
    case Kind::dynamic:
      return "dynamic";
    case Kind::yarn:
      return "yarn";
    default:
      return "none";
  }
}

namespace {

// As io/hf.cpp reads config.json's (dynamic and yarn scale from max_position_embeddings, yarn's
// attention_factor defaults to 0.1 ln(factor) + 1), except that a key the kind does not use,
// which config.json refuses, is warned of and left at its default unless it holds that already
// (pollen's config.toml writes every key, and a checkpoint of an older pollen may hold one set
// for nothing).
ops::RopeScaling read_rope_scaling(ConfigTable& t, int64_t max_position_embeddings) {
  using Kind = ops::RopeScaling::Kind;
  ops::RopeScaling s;
  const std::string kind = t.require_string("kind");
  bool known = false;
  for (Kind k : {Kind::none, Kind::linear, Kind::llama3, Kind::dynamic, Kind::yarn})
    if (kind == rope_scaling_kind_name(k)) s.kind = k, known = true;
  POLLEN_CHECK(known, t.where("kind"), ": expected none, linear, llama3, dynamic or yarn, got '",
               kind, "'");
  const bool from_max = s.kind == Kind::dynamic || s.kind == Kind::yarn;
  if (from_max) s.original_max_position_embeddings = max_position_embeddings;
  s.factor = t.get_double("factor", s.factor);
  if (s.kind == Kind::yarn) s.attention_factor = 0.1 * std::log(s.factor) + 1.0;
  const ops::RopeScaling defaults = s;
  s.low_freq_factor = t.get_double("low_freq_factor", s.low_freq_factor);
  s.high_freq_factor = t.get_double("high_freq_factor", s.high_freq_factor);
  s.original_max_position_embeddings =
      t.get_int("original_max_position_embeddings", s.original_max_position_embeddings);
  s.attention_factor = t.get_double("attention_factor", s.attention_factor);
  s.beta_fast = t.get_double("beta_fast", s.beta_fast);
  s.beta_slow = t.get_double("beta_slow", s.beta_slow);
  const auto unused_to_default = [&](const char* key, bool used, auto& value,
                                     const auto& fallback) {
    if (used || value == fallback) return;
    log::warn(t.where(key), ": rope_scaling kind '", kind, "' does not use it; ignored");
    value = fallback;
  };
  unused_to_default("factor", s.kind != Kind::none, s.factor, defaults.factor);
  unused_to_default("low_freq_factor", s.kind == Kind::llama3, s.low_freq_factor,
                    defaults.low_freq_factor);
  unused_to_default("high_freq_factor", s.kind == Kind::llama3, s.high_freq_factor,
                    defaults.high_freq_factor);
  unused_to_default("original_max_position_embeddings", s.kind == Kind::llama3 || from_max,
                    s.original_max_position_embeddings, defaults.original_max_position_embeddings);
  unused_to_default("attention_factor", s.kind == Kind::yarn, s.attention_factor,
                    defaults.attention_factor);
  unused_to_default("beta_fast", s.kind == Kind::yarn, s.beta_fast, defaults.beta_fast);
  unused_to_default("beta_slow", s.kind == Kind::yarn, s.beta_slow, defaults.beta_slow);
  POLLEN_CHECK(!from_max || s.factor >= 1, t.where("factor"), ": must be >= 1 for kind '", kind,
               "', got ", s.factor);
  POLLEN_CHECK(s.kind != Kind::yarn ||
                   (s.attention_factor > 0 && s.beta_fast > s.beta_slow && s.beta_slow > 0),
               t.where("kind"), ": yarn needs attention_factor > 0 and beta_fast > beta_slow > 0");
  t.finish();
  return s;
}

}  // namespace

LlamaConfig read_config(ConfigTable& t) {
  LlamaConfig c;
  std::string base = t.get_string("preset", "");
  if (!base.empty()) {
    try {
      c = preset(base);
    } catch (const Error& e) {
      fail(t.where("preset"), ": ", e.what());
    }
  }
  c.name = t.get_string("name", base.empty() ? "custom" : base);
  c.vocab_size = t.get_int("vocab_size", c.vocab_size);
  c.hidden_size = t.get_int("hidden_size", c.hidden_size);
  c.intermediate_size = t.get_int("intermediate_size", c.intermediate_size);
  c.num_hidden_layers = t.get_int("num_hidden_layers", c.num_hidden_layers);
  c.num_attention_heads = t.get_int("num_attention_heads", c.num_attention_heads);
  c.num_key_value_heads = t.get_int("num_key_value_heads", c.num_key_value_heads);
  c.head_dim = t.get_int("head_dim", c.head_dim);
  c.max_position_embeddings = t.get_int("max_position_embeddings", c.max_position_embeddings);
  c.rope_theta = t.get_double("rope_theta", c.rope_theta);
  c.rms_norm_eps = t.get_double("rms_norm_eps", c.rms_norm_eps);
  c.tie_word_embeddings = t.get_bool("tie_word_embeddings", c.tie_word_embeddings);
  c.attention_bias = t.get_bool("attention_bias", c.attention_bias);
  c.initializer_range = t.get_double("initializer_range", c.initializer_range);
  c.sliding_window = t.get_int("sliding_window", c.sliding_window);
  if (auto r = t.table("rope_scaling"))
    c.rope_scaling = read_rope_scaling(*r, c.max_position_embeddings);
  t.finish();
  try {
    c.validate();
  } catch (const Error& e) {
    fail("config file '", t.source(), "': ", e.what());  // the key is in the message
  }
  return c;
}

std::vector<std::string> architecture_differences(const LlamaConfig& expected,
                                                  const LlamaConfig& got) {
  std::vector<std::string> out;
  auto check = [&](const char* key, const auto& a, const auto& b) {
    if (a == b) return;
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, bool>) {
      out.push_back(cat(key, ": expected ", a ? "true" : "false", ", got ", b ? "true" : "false"));
    } else {
      out.push_back(cat(key, ": expected ", a, ", got ", b));
    }
  };
  check("vocab_size", expected.vocab_size, got.vocab_size);
  check("hidden_size", expected.hidden_size, got.hidden_size);
  check("intermediate_size", expected.intermediate_size, got.intermediate_size);
  check("num_hidden_layers", expected.num_hidden_layers, got.num_hidden_layers);
  check("num_attention_heads", expected.num_attention_heads, got.num_attention_heads);
  check("num_key_value_heads", expected.num_key_value_heads, got.num_key_value_heads);
  check("head_dim", expected.resolved_head_dim(), got.resolved_head_dim());
  check("max_position_embeddings", expected.max_position_embeddings, got.max_position_embeddings);
  check("rope_theta", expected.rope_theta, got.rope_theta);
  check("rms_norm_eps", expected.rms_norm_eps, got.rms_norm_eps);
  check("tie_word_embeddings", expected.tie_word_embeddings, got.tie_word_embeddings);
  check("attention_bias", expected.attention_bias, got.attention_bias);
  check("sliding_window", expected.sliding_window, got.sliding_window);
  if (!(expected.rope_scaling == got.rope_scaling)) out.push_back("rope_scaling differs");
  return out;
}

void check_model_file_stands_alone(const ConfigTable& model) {
  // read_config's keys (a misspelt one is left to be named as unknown).
  static const std::set<std::string> architecture = {"preset",
                                                     "name",
                                                     "vocab_size",
                                                     "hidden_size",
                                                     "intermediate_size",
                                                     "num_hidden_layers",
                                                     "num_attention_heads",
                                                     "num_key_value_heads",
                                                     "head_dim",
                                                     "max_position_embeddings",
                                                     "rope_theta",
                                                     "rms_norm_eps",
                                                     "initializer_range",
                                                     "tie_word_embeddings",
                                                     "attention_bias",
                                                     "sliding_window",
                                                     "rope_scaling"};
  for (const auto& [key, value] : model.flat()) {
    std::string name = key.substr(key.find('.') + 1);  // without "model."
    name = name.substr(0, name.find('.'));             // rope_scaling.kind: rope_scaling
    POLLEN_CHECK(!architecture.count(name), model.where(name),
                 ": model.file holds the whole architecture; give either the file or a preset "
                 "with its keys, not both");
  }
}

LlamaConfig load_config(const std::filesystem::path& path) {
  ConfigTable root = ConfigTable::load(path);
  if (auto m = root.table("model")) {
    root.finish();
    return read_config(*m);
  }
  return read_config(root);
}

LlamaConfig resolve_config(const std::string& preset_or_file) {
  if (preset_or_file.ends_with(".toml")) return load_config(preset_or_file);
  LlamaConfig c = preset(preset_or_file);
  c.validate();
  return c;
}

}  // namespace pollen::model
