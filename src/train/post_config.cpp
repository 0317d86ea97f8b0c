#include "train/post_config.h"

#include <toml++/toml.h>

#include <sstream>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/chat_template.h"
#include "train/toml_text.h"

namespace fs = std::filesystem;

namespace pollen::train {
namespace {

// A table's keys as (dotted key, TOML value) pairs: a nested table such as [grpo.verifier]
// becomes `grpo.verifier.kind`, which the resolved config writes back as a dotted key.
void add_flat_keys(const toml::table& table, const std::string& prefix,
                   std::vector<std::pair<std::string, std::string>>& keys) {
  for (const auto& [k, v] : table) {
    const std::string key = prefix + "." + std::string(k.str());
    if (const toml::table* nested = v.as_table()) {
      add_flat_keys(*nested, key, keys);
      continue;
    }
    keys.emplace_back(key, toml_text(v));
  }
}

// The objective's section of the run file as (key, TOML value) pairs and as TOML text.
void capture_objective_section(const std::string& text, const std::string& source, PostConfig& c) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail("config file '", source, "': ", e.description(), " at line ", e.source().begin.line,
         ", column ", e.source().begin.column);
  }
  toml::table section;
  if (const toml::node* n = root.get(c.objective)) {
    POLLEN_CHECK(n->is_table(), "config file '", source, "', key '", c.objective,
                 "': expected a table");
    section = *n->as_table();
  }
  add_flat_keys(section, c.objective, c.objective_keys);
  toml::table wrapped;
  wrapped.insert(c.objective, section);
  c.objective_text = toml_text(wrapped);
  // The section's identity (a federated silo's data version), printed as toml++ prints it by
  // default, as pollen always has: states and lineage recorded before stay comparable.
  std::ostringstream identity;
  identity << wrapped;
  c.objective_identity = identity.str();
  if (section.empty()) c.objective_text = c.objective_identity = "[" + c.objective + "]\n";
}

}  // namespace

ConfigTable PostConfig::objective_section() const {
  ConfigTable root = ConfigTable::parse(objective_text, source);
  return *root.table(objective);
}

std::vector<fs::path> PostConfig::data_files() const {
  ConfigTable section = objective_section();
  std::vector<fs::path> files;
  for (const char* key : {"data", "validation", "eval_data"}) {
    const std::string path = section.has(key) ? section.get_string(key, "") : "";
    if (!path.empty()) files.emplace_back(resolve_config_path(base_dir, path));
  }
  return files;
}

PostConfig parse_post_config(const std::string& text, const std::string& source,
                             const std::string& objective,
                             const std::vector<std::string>& overrides, const fs::path& base_dir) {
  auto resolve = [&](const std::string& p) { return resolve_config_path(base_dir, p); };
  const auto [effective, name] = apply_overrides(text, source, overrides);
  ConfigTable t = ConfigTable::parse(effective, name);
  PostConfig c;
  c.objective = objective;
  c.source = name;
  c.base_dir = base_dir;

  auto run = t.table("run");
  read_run_keys(run ? &*run : nullptr, source, base_dir, c);
  if (run) run->finish();

  auto model = t.table("model");
  POLLEN_CHECK(model.has_value(), "config file '", name,
               "': missing [model] (base: a preset, model file, checkpoint or HF directory)");
  c.base = model->require_string("base");
  // A preset's name (no '/', no extension) stays as it is; a file or folder is found relative to
  // the run file (also one that is gone, as a resumed full fine-tune's base may be) and kept as
  // an absolute path, so that a checkpoint naming its base opens from any folder.
  const bool preset_like =
      c.base.find('/') == std::string::npos && !fs::path(c.base).has_extension();
  if (!preset_like || fs::exists(base_dir / c.base))
    c.base = fs::absolute(resolve(c.base)).lexically_normal().string();
  c.tokenizer = model->get_string("tokenizer", "");
  if (!c.tokenizer.empty()) c.tokenizer = resolve(c.tokenizer);
  c.chat_template = model->get_string("chat_template", "");
  if (!c.chat_template.empty()) {
    try {
      tokenizer::chat_template_named(c.chat_template);
    } catch (const Error& e) {
      fail(model->where("chat_template"), ": ", e.what());
    }
  }
  // A resolved config (a checkpoint's) also holds the architecture.
  if (model->has("vocab_size")) {
    c.architecture = model::read_config(*model);
  } else {
    model->finish();
  }

  auto train = t.table("train");
  POLLEN_CHECK(train.has_value(), "config file '", name, "': missing [train] (steps)");
  read_train_keys(*train, c);
  train->finish();

  // Post-training starts from a trained model: a smaller default rate than pre-training's.
  c.optimizer.lr = 1e-4;
  c.optimizer.weight_decay = 0.0;
  if (auto o = t.table("optimizer")) read_optimizer(*o, c.optimizer);
  c.schedule.lr = c.optimizer.lr;
  c.schedule.total_steps = c.steps;
  c.schedule.min_lr = 0;
  if (auto s = t.table("schedule")) read_schedule(*s, c.schedule);

  if (auto e = t.table("eval")) {
    read_eval_keys(*e, c);
    e->finish();
  }
  if (auto k = t.table("checkpoint")) read_checkpoint(*k, c);
  if (auto m = t.table("metrics")) {
    read_metrics_keys(*m, c);
    m->finish();
  }
  if (auto p = t.table("parallel")) {
    c.zero = read_zero_key(*p);
    read_reduction_keys(*p, c.bucket_mb, c.timeout_s);
    p->finish();
  }
  if (auto l = t.table("lora")) {
    c.lora.enabled = l->get_bool("enabled", true);
    c.lora.config = model::read_lora_config(*l, c.seed);  // the seed defaults to the run's
    l->finish();
  }
  (void)t.table(objective);  // the objective reads and checks its own section
  // Another objective's section in place of this one's: the file is another command's.
  for (const char* other : {"sft", "dpo", "rm", "grpo"})
    POLLEN_CHECK(other == objective || t.has(objective) || !t.has(other), "config file '", name,
                 "' has [", other, "] and no [", objective, "]: it is a run file of pollen ", other,
                 ", not of pollen ", objective,
                 " (or federation.objective / post.objective "
                 "names another objective than the run file's)");
  t.finish();
  capture_objective_section(effective, name, c);
  return c;
}

PostConfig load_post_config(const fs::path& path, const std::string& objective,
                            const std::vector<std::string>& overrides) {
  // Against the run file's absolute folder, as pollen train's: the run folder's config.toml
  // then names its base and data wherever a later command runs from.
  return parse_post_config(read_config_file(path), path.string(), objective, overrides,
                           fs::absolute(path).parent_path());
}

std::vector<std::pair<std::string, std::string>> PostConfig::flat(
    const model::LlamaConfig& arch) const {
  std::vector<std::pair<std::string, std::string>> f;
  auto i = [](int64_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  flat_run(*this, f);
  f.emplace_back("model.base", toml_string(base));
  f.emplace_back("model.tokenizer", toml_string(tokenizer));
  f.emplace_back("model.chat_template", toml_string(chat_template));
  flat_model(arch, f);
  f.emplace_back("train.steps", i(steps));
  f.emplace_back("train.grad_clip", toml_double(grad_clip));
  f.emplace_back("train.max_bad_steps", i(max_bad_steps));
  flat_optimizer(optimizer, schedule, f);
  f.emplace_back("eval.interval", i(eval_interval));
  flat_checkpoint_metrics(*this, f);
  if (lora.enabled) {
    const model::LoraConfig& l = lora.config;
    std::vector<std::string> targets;
    for (const model::LoraTarget t : l.targets) targets.emplace_back(model::lora_target_name(t));
    f.emplace_back("lora.rank", i(l.rank));
    f.emplace_back("lora.alpha", toml_double(l.alpha));
    f.emplace_back("lora.dropout", toml_double(l.dropout));
    f.emplace_back("lora.target_modules", toml_strings(targets));
    f.emplace_back("lora.rslora", b(l.rslora));
    f.emplace_back("lora.train_a", b(l.train_a));
    f.emplace_back("lora.seed", i(static_cast<int64_t>(l.seed)));
  }
  f.emplace_back("parallel.zero", i(zero));
  f.emplace_back("parallel.bucket_mb", toml_double(bucket_mb));
  f.emplace_back("parallel.timeout_s", toml_double(timeout_s));
  f.insert(f.end(), objective_keys.begin(), objective_keys.end());
  return f;
}

std::string PostConfig::to_toml(const model::LlamaConfig& arch) const {
  std::string out = flat_to_toml(flat(arch), cat("# Resolved by pollen ", objective,
                                                 ": every key with the value the run used.\n"));
  if (objective_keys.empty()) out += "\n[" + objective + "]\n";
  return out;
}

}  // namespace pollen::train
