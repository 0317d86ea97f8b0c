#include "io/model_source.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "base/config.h"
#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "base/log.h"
#include "io/checkpoint.h"
#include "io/hf.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/open.h"
#include "tokenizer/tokenizer.h"

namespace pollen::io {
namespace fs = std::filesystem;
namespace {

// The files of a checkpoint that a model is loaded from, and so the ones checked against its
// manifest (optimizer state is neither needed nor hashed; a resumed run checks everything).
const std::vector<std::string> kModelFiles = {"model.safetensors",   "adapter_model.safetensors",
                                              "adapter_config.json", "objective.safetensors",
                                              "config.toml",         "tokenizer.json"};

// The newest checkpoint under `root` whose model files verify (its optimizer state may be
// missing or changed: resuming a run, which needs it, checks every file instead), each newer
// one passed over named in a warning. None: `why` says what failed in the newest.
std::optional<fs::path> newest_model_checkpoint(const std::string& spec, const fs::path& root,
                                                std::string& why) {
  const std::vector<fs::path> all = list_checkpoints(root);
  why = cat("no checkpoint in '", root.string(), "'");
  std::vector<std::pair<fs::path, std::string>> skipped;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (auto failed = verify_checkpoint(*it, kModelFiles)) {
      if (it == all.rbegin()) why = cat("the newest, '", it->string(), "': ", *failed);
      skipped.emplace_back(*it, *failed);
      continue;
    }
    for (const auto& [dir, reason] : skipped)
      log::warn("model '", spec, "': skipping checkpoint '", dir.string(), "': ", reason);
    return *it;
  }
  return std::nullopt;
}

// Whether the tokenizer beside a data manifest is the one the manifest records (a file replaced
// since would tokenize, and decode, unlike the data the model trained on); warns when not.
bool tokenizer_matches_manifest(const fs::path& tokenizer, const fs::path& manifest) {
  if (!fs::is_regular_file(manifest)) return true;  // nothing recorded to hold it to
  const auto m = nlohmann::json::parse(read_file(manifest), nullptr, false);
  const auto t = m.is_object() ? m.value("tokenizer", nlohmann::json()) : nlohmann::json();
  const std::string recorded = t.is_object() ? t.value("fingerprint", "") : "";
  if (recorded.empty()) return true;
  std::string found;
  try {
    found = tokenizer::open_tokenizer(tokenizer, "").fingerprint();
  } catch (const Error& e) {
    log::warn("tokenizer '", tokenizer.string(), "' cannot be read (", e.what(),
              "): not taken as the model's tokenizer");
    return false;
  }
  if (found == recorded) return true;
  log::warn("tokenizer '", tokenizer.string(), "' is not the one '", manifest.string(),
            "' was tokenized with (fingerprint ", found.substr(0, 16), ", the manifest records ",
            recorded.substr(0, 16), "): not taken as the model's tokenizer");
  return false;
}

// The tokenizer of a checkpoint: tokenizer.json in the folder, else the one beside the first
// data manifest of the run (as `pollen data prepare` writes it) when it is still the one the
// manifest records.
std::optional<fs::path> checkpoint_tokenizer(const fs::path& dir, ConfigTable& root) {
  if (fs::is_regular_file(dir / "tokenizer.json")) return dir / "tokenizer.json";
  auto data = root.table("data");
  if (!data) return std::nullopt;
  for (const auto& m : data->get_strings("manifests")) {
    for (const fs::path& base : {fs::path(), dir.parent_path().parent_path()}) {
      const fs::path manifest = fs::path(m).is_absolute() ? fs::path(m) : base / m;
      const fs::path candidate = manifest.parent_path() / "tokenizer.json";
      if (fs::is_regular_file(candidate) && tokenizer_matches_manifest(candidate, manifest))
        return candidate;
    }
  }
  return std::nullopt;
}

// Whether a run's chat template ("chatml", "llama3"; empty: none named) is the one `base`
// carries (a template it does not carry, or one pollen does not recognise, is another).
bool same_template_as(const std::string& name, const ModelSource& base) {
  if (name.empty()) return true;
  try {
    const std::optional<std::string> jinja = model_chat_template(base);
    return jinja && tokenizer::recognise_chat_template(*jinja, "the base's chat template").kind ==
                        tokenizer::chat_template_named(name);
  } catch (const Error&) {
    return false;
  }
}

// A LoRA run's checkpoint: the base that its config.toml's model.base names (resolved as --model
// resolves it), with the run's tokenizer and chat template, and the adapters in the folder.
ModelSource resolve_lora_checkpoint(const std::string& spec, const fs::path& dir) {
  const fs::path config = dir / "config.toml";
  ConfigTable root = ConfigTable::load(config);
  auto m = root.table("model");
  POLLEN_CHECK(m.has_value(), "'", config.string(), "' has no [model] table");
  const std::string base = m->get_string("base", "");
  POLLEN_CHECK(!base.empty(), "model '", spec, "': a LoRA checkpoint whose '", config.string(),
               "' names no model.base; pass the base as --model and this folder as --adapter");
  ModelSource s;
  s.spec = spec;
  s.kind = ModelSource::Kind::checkpoint;
  s.path = dir;
  try {
    s.base = std::make_shared<const ModelSource>(resolve_model(base));
  } catch (const Error& e) {
    fail("model '", spec, "': the base of this LoRA checkpoint (model.base in '", config.string(),
         "'): ", e.what());
  }
  auto run = root.table("run");
  s.base_seed = run ? static_cast<uint64_t>(run->get_int("seed", 0)) : 0;
  s.config = s.base->config;
  const std::string chat_template = m->get_string("chat_template", "");
  if (!chat_template.empty())
    s.chat_template = chat_template;
  else
    s.chat_template = s.base->chat_template;
  s.tokenizer = checkpoint_tokenizer(dir, root);
  if (!s.tokenizer) s.tokenizer = s.base->tokenizer;
  // An HF base's tokenizer and generation configs carry its own template and end of turn: a run
  // trained with another template writes its own, as a full fine-tune's export does.
  if (same_template_as(chat_template, *s.base)) s.hf_side_files = s.base->hf_side_files;
  return s;
}

}  // namespace

const char* model_kind_name(ModelSource::Kind kind) {
  switch (kind) {
    case ModelSource::Kind::preset:
      return "preset";
    case ModelSource::Kind::model_file:
      return "model file";
    case ModelSource::Kind::checkpoint:
      return "pollen checkpoint";
    case ModelSource::Kind::hf_dir:
      return "HF directory";
  }
  return "?";
}

void refuse_adapter_only_checkpoint(const fs::path& dir, const std::string& what) {
  if (!fs::is_regular_file(dir / "state.json") || fs::exists(dir / "config.toml")) return;
  const auto state = nlohmann::json::parse(read_file(dir / "state.json"), nullptr, false);
  if (!state.is_object() || !state.contains("post_objective")) return;
  fs::path step = dir.lexically_normal();
  if (step.filename().empty()) step = step.parent_path();    // "step-N/"
  const fs::path server = step.parent_path().parent_path();  // SERVER_DIR/checkpoints/step-N
  fail(what, ": '", dir.string(), "' is a checkpoint of a federated post-training server; ",
       "it holds the global LoRA adapters alone, not a model: pass the base model as --model and ",
       "the server's adapters as --adapter '", (server / "adapter").string(),
       "' (pollen export hf takes both too)");
}

ModelSource resolve_model(const std::string& spec) {
  ModelSource s;
  s.spec = spec;
  const fs::path p(spec);
  if (fs::is_directory(p)) {
    if (is_hf_dir(p)) {
      s.kind = ModelSource::Kind::hf_dir;
      s.path = p;
      s.config = read_hf_config(p / "config.json");
      if (fs::is_regular_file(p / "tokenizer.json")) s.tokenizer = p / "tokenizer.json";
      for (const char* f : {"tokenizer_config.json", "special_tokens_map.json",
                            "generation_config.json", "chat_template.jinja"})
        if (fs::is_regular_file(p / f)) s.hf_side_files.push_back(p / f);
      return s;
    }
    fs::path dir = p;
    bool verified = false;
    if (!fs::is_regular_file(dir / "model.safetensors") && fs::is_directory(dir / "checkpoints")) {
      std::string why;
      const auto newest = newest_model_checkpoint(spec, dir / "checkpoints", why);
      POLLEN_CHECK(newest.has_value(), "model '", spec,
                   "': a run folder without a checkpoint that verifies (", why, ")");
      dir = *newest;
      verified = true;
    }
    refuse_adapter_only_checkpoint(dir, cat("model '", spec, "'"));
    const bool lora = !fs::is_regular_file(dir / "model.safetensors") &&
                      fs::is_regular_file(dir / "adapter_config.json") &&
                      fs::is_regular_file(dir / "config.toml");
    POLLEN_CHECK(lora || (fs::is_regular_file(dir / "model.safetensors") &&
                          fs::is_regular_file(dir / "config.toml")),
                 "model '", spec, "': a folder that is neither an HF directory (config.json + ",
                 "model.safetensors or its index) nor a pollen checkpoint (model.safetensors + ",
                 "config.toml) nor a run folder with checkpoints/");
    // A checkpoint named directly: the files it is loaded from must be the ones it wrote. A
    // training checkpoint always has a manifest; one without it cannot be checked.
    POLLEN_CHECK(verified || fs::is_regular_file(dir / "manifest.json") ||
                     !(fs::exists(dir / "state.json") || fs::exists(dir / "optimizer.safetensors")),
                 "model '", spec, "': '", dir.string(), "' is a pollen training checkpoint (it ",
                 "holds state.json or optimizer.safetensors) without manifest.json, which every ",
                 "checkpoint is written with, so its files cannot be verified");
    if (!verified && fs::is_regular_file(dir / "manifest.json")) {
      if (auto why = verify_checkpoint(dir, kModelFiles))
        fail("model '", spec, "': checkpoint '", dir.string(), "' does not verify: ", *why);
    }
    if (lora) return resolve_lora_checkpoint(spec, dir);
    s.kind = ModelSource::Kind::checkpoint;
    s.path = dir;
    ConfigTable root = ConfigTable::load(dir / "config.toml");
    auto m = root.table("model");
    POLLEN_CHECK(m.has_value(), "'", (dir / "config.toml").string(), "' has no [model] table");
    m->get_string("init_from", "");  // where that run started: not part of the model
    // A post-training checkpoint's [model] also names its base, tokenizer and chat template.
    m->get_string("base", "");
    const std::string tokenizer = m->get_string("tokenizer", "");
    const std::string chat_template = m->get_string("chat_template", "");
    if (!chat_template.empty()) s.chat_template = chat_template;
    s.config = model::read_config(*m);
    s.tokenizer = checkpoint_tokenizer(dir, root);
    if (!s.tokenizer && !tokenizer.empty() && fs::is_regular_file(tokenizer))
      s.tokenizer = tokenizer;
    return s;
  }
  if (spec.ends_with(".toml")) {
    POLLEN_CHECK(fs::is_regular_file(p), "model '", spec, "': no such model file");
    s.kind = ModelSource::Kind::model_file;
    s.path = p;
    s.config = model::load_config(p);
    return s;
  }
  // A preset name has neither a '/' nor an extension: anything else that reaches here was meant
  // as a path, and the error is that it names nothing, not that it is an unknown preset.
  const bool exists = fs::exists(p);
  POLLEN_CHECK(exists || (spec.find('/') == std::string::npos && !p.has_extension()), "model '",
               spec, "': no such file or folder (expected a run folder, a checkpoint folder, ",
               "an HF directory or a .toml model file)");
  POLLEN_CHECK(!exists, "model '", spec, "': a file that is not a model (expected a run folder, ",
               "a checkpoint folder, an HF directory, a .toml model file or a preset)");
  s.kind = ModelSource::Kind::preset;
  try {
    s.config = model::resolve_config(spec);
  } catch (const Error& e) {
    fail(e.what(), "; nor is there a file or folder '", spec, "'");
  }
  return s;
}

fs::path tokenizer_config_dir(const ModelSource& source, const fs::path& tokenizer) {
  for (const auto& f : source.hf_side_files)
    if (f.filename() == "tokenizer_config.json") return f.parent_path();
  if (!tokenizer.empty()) return tokenizer.parent_path();
  return source.tokenizer ? source.tokenizer->parent_path() : source.path;
}

std::optional<std::string> model_chat_template(const ModelSource& source,
                                               const fs::path& tokenizer) {
  if (source.chat_template)
    return std::string(
        tokenizer::chat_template_jinja(tokenizer::chat_template_named(*source.chat_template)));
  return tokenizer::chat_template_text(tokenizer_config_dir(source, tokenizer) /
                                       "tokenizer_config.json");
}

model::Llama load_model(const ModelSource& s, DType dtype, uint64_t seed) {
  if (s.base) {
    const model::Llama base = load_model(*s.base, dtype, s.base_seed);
    return model::merge_lora(base, *load_peft_adapter(s.path, base.config(), dtype, true, &base));
  }
  switch (s.kind) {
    case ModelSource::Kind::preset:
    case ModelSource::Kind::model_file:
      return model::Llama(s.config, seed, dtype);
    case ModelSource::Kind::hf_dir:
      return load_hf_model(s.path, dtype);
    case ModelSource::Kind::checkpoint: {
      const fs::path file = s.path / "model.safetensors";
      // A run's newest checkpoint may be removed by its retention (checkpoint.keep) between
      // being chosen and being read: said so, rather than a bare "no such file".
      POLLEN_CHECK(fs::is_regular_file(file), "model '", s.spec, "': checkpoint '", s.path.string(),
                   "' was removed after it was chosen (a running run's checkpoint.keep "
                   "retention?); run the command again to take the newest one");
      const SafetensorsFile f = read_safetensors(file);
      size_t used = 0;
      model::Llama m(
          s.config,
          [&](const std::string& name, const Shape& shape) {
            const Tensor* t = f.find(name);
            POLLEN_CHECK(t != nullptr, "'", file.string(), "' has no tensor '", name, "'");
            POLLEN_CHECK(t->shape() == shape, "'", file.string(), "': tensor '", name, "' is ",
                         shape_str(t->shape()), ", config.toml implies ", shape_str(shape));
            POLLEN_CHECK(dtype_is_float(t->dtype()), "'", file.string(), "': tensor '", name,
                         "' has dtype ", dtype_name(t->dtype()), "; weights are floating point");
            ++used;
            return t->dtype() == dtype ? *t : t->to(dtype);
          },
          dtype);
      POLLEN_CHECK(used == f.tensors.size(), "'", file.string(), "' holds ",
                   f.tensors.size() - used, " tensors that are not parameters of the model");
      return m;
    }
  }
  fail("unreachable");
}

model::Llama load_initial_weights(const std::string& spec, const model::LlamaConfig& expected,
                                  const std::string& key, ModelSource* resolved) {
  const ModelSource source = [&] {
    try {
      return resolve_model(spec);
    } catch (const Error& e) {
      fail(key, ": ", e.what());
    }
  }();
  POLLEN_CHECK(
      source.kind == ModelSource::Kind::checkpoint || source.kind == ModelSource::Kind::hf_dir, key,
      " '", spec, "': a ", model_kind_name(source.kind),
      " holds no weights; expected a pollen checkpoint (step-N/), a run folder or an HF ",
      "directory");
  const auto differences = model::architecture_differences(expected, source.config);
  if (!differences.empty()) {
    std::string list;
    for (const auto& d : differences) list += (list.empty() ? "" : "; ") + d;
    fail(key, " '", spec, "' (", model_kind_name(source.kind), " ", source.path.string(),
         ") has another architecture than the run's [model]: ", list);
  }
  if (resolved) *resolved = source;
  log::info(key, ": starting from the weights of ", model_kind_name(source.kind), " ",
            source.path.string());
  // Rebuilt under the run's config (its name and initializer_range), the tensors shared.
  const model::Llama loaded = load_model(source);
  std::map<std::string, Tensor> weights;
  for (const auto& [name, var] : loaded.named_parameters()) weights.emplace(name, var.value());
  return model::Llama(expected,
                      [&](const std::string& name, const Shape&) { return weights.at(name); });
}

std::string pinned_model_spec(const std::string& spec, const ModelSource& source) {
  const bool run_folder = source.kind == ModelSource::Kind::checkpoint && fs::is_directory(spec) &&
                          fs::path(spec).lexically_normal() != source.path.lexically_normal();
  return run_folder ? fs::absolute(source.path).lexically_normal().string() : spec;
}

namespace {

// The file HF derives the generation config from: generation_config.json, else an HF
// directory's config.json; empty when the model has neither.
nlohmann::json generation_config(const ModelSource& source) {
  for (const auto& f : source.hf_side_files)
    if (f.filename() == "generation_config.json")
      return parse_json_object(read_file(f), cat("'", f.string(), "'"));
  const fs::path config = source.path / "config.json";
  if (source.kind == ModelSource::Kind::hf_dir && fs::is_regular_file(config))
    return parse_json_object(read_file(config), cat("'", config.string(), "'"));
  return nlohmann::json::object();
}

}  // namespace

std::vector<uint32_t> model_stop_tokens(const ModelSource& source,
                                        const tokenizer::Tokenizer& tok) {
  std::vector<uint32_t> ids;
  const auto add = [&](uint32_t id) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  const nlohmann::json j = generation_config(source);
  if (j.contains("eos_token_id")) {
    const auto& e = j["eos_token_id"];
    if (e.is_number_unsigned()) add(e.get<uint32_t>());
    if (e.is_array())
      for (const auto& v : e)
        if (v.is_number_unsigned()) add(v.get<uint32_t>());
  }
  for (const auto& t : tok.added_tokens()) {
    if (t.special &&
        (t.content == "<|endoftext|>" || t.content == "</s>" || t.content == "<|eot_id|>" ||
         t.content == "<|im_end|>" || t.content == "<|end_of_text|>"))
      add(t.id);
  }
  return ids;
}

std::optional<uint32_t> model_bos_id(const ModelSource& source) {
  const nlohmann::json j = generation_config(source);
  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_unsigned())
    return j["bos_token_id"].get<uint32_t>();
  return std::nullopt;
}

}  // namespace pollen::io
