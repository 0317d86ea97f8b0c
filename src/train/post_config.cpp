#include "train/post_config.h"

#include <toml++/toml.h>

#include <sstream>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/chat_template.h"

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
    std::ostringstream value;
    v.visit([&](const auto& node) { value << node; });
    keys.emplace_back(key, value.str());
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
  std::ostringstream out;
  out << wrapped;
  c.objective_text = out.str();
  if (section.empty()) c.objective_text = "[" + c.objective + "]\n";
}

}  // namespace

ConfigTable PostConfig::objective_section() const {
  ConfigTable root = ConfigTable::parse(objective_text, source);
  return *root.table(objective);
}

PostConfig parse_post_config(const std::string& text, const std::string& source,
                             const std::string& objective,
                             const std::vector<std::string>& overrides, const fs::path& base_dir) {
  auto resolve = [&](const std::string& p) {
    const fs::path path(p);
    return base_dir.empty() || path.is_absolute() ? p
                                                  : (base_dir / path).lexically_normal().string();
  };
  const auto [effective, name] = apply_overrides(text, source, overrides);
  ConfigTable t = ConfigTable::parse(effective, name);
  PostConfig c;
  c.objective = objective;
  c.source = name;
  c.base_dir = base_dir;

  const std::string stem = fs::path(source).stem().string();
  c.name = stem;
  c.dir = "runs/" + stem;
  if (auto run = t.table("run")) {
    c.name = run->get_string("name", stem);
    c.dir = run->has("dir") ? resolve(run->get_string("dir", "")) : "runs/" + c.name;
    const int64_t seed = run->get_int("seed", 0);
    POLLEN_CHECK(seed >= 0, run->where("seed"), ": expected a non-negative integer");
    c.seed = static_cast<uint64_t>(seed);
    c.threads = static_cast<int>(run->get_int("threads", 0));
    POLLEN_CHECK(c.threads >= 0, run->where("threads"), ": expected 0 (all) or more");
    run->finish();
  }

  auto model = t.table("model");
  POLLEN_CHECK(model.has_value(), "config file '", name,
               "': missing [model] (base: a preset, model file, checkpoint or HF directory)");
  c.base = model->require_string("base");
  // A preset's name stays as it is; a file or folder is found relative to the run file and
  // kept as an absolute path, so that a checkpoint naming its base opens from any folder.
  if (fs::exists(base_dir / c.base))
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
  c.steps = train->require_int("steps");
  POLLEN_CHECK(c.steps > 0, train->where("steps"), ": expected a positive integer");
  c.grad_clip = train->get_double("grad_clip", 1.0);
  POLLEN_CHECK(c.grad_clip >= 0, train->where("grad_clip"), ": expected 0 (off) or more");
  c.max_bad_steps = train->get_int("max_bad_steps", 5);
  POLLEN_CHECK(c.max_bad_steps > 0, train->where("max_bad_steps"), ": expected 1 or more");
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
    c.eval_interval = e->get_int("interval", 0);
    POLLEN_CHECK(c.eval_interval >= 0, e->where("interval"), ": expected 0 (end only) or more");
    e->finish();
  }
  if (auto k = t.table("checkpoint")) {
    c.checkpoint_interval = k->get_int("interval", 0);
    POLLEN_CHECK(c.checkpoint_interval >= 0, k->where("interval"),
                 ": expected 0 (end only) or more");
    c.keep_checkpoints = static_cast<int>(k->get_int("keep", 3));
    POLLEN_CHECK(c.keep_checkpoints >= 0, k->where("keep"), ": expected 0 (all) or more");
    k->finish();
  }
  if (auto m = t.table("metrics")) {
    c.tensorboard = m->get_bool("tensorboard", true);
    c.log_interval = m->get_int("log_interval", 10);
    POLLEN_CHECK(c.log_interval > 0, m->where("log_interval"), ": expected 1 or more");
    m->finish();
  }
  if (auto l = t.table("lora")) {
    c.lora.enabled = l->get_bool("enabled", true);
    c.lora.config = model::read_lora_config(*l, c.seed);  // the seed defaults to the run's
    l->finish();
  }
  (void)t.table(objective);  // the objective reads and checks its own section
  t.finish();
  capture_objective_section(effective, name, c);
  return c;
}

PostConfig load_post_config(const fs::path& path, const std::string& objective,
                            const std::vector<std::string>& overrides) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    fail("cannot read config file '", path.string(), "': ", e.what());
  }
  return parse_post_config(text, path.string(), objective, overrides, path.parent_path());
}

std::vector<std::pair<std::string, std::string>> PostConfig::flat(
    const model::LlamaConfig& arch) const {
  std::vector<std::pair<std::string, std::string>> f;
  auto i = [](int64_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  f.emplace_back("run.name", toml_string(name));
  f.emplace_back("run.dir", toml_string(dir.string()));
  f.emplace_back("run.seed", i(static_cast<int64_t>(seed)));
  f.emplace_back("run.threads", i(threads));
  f.emplace_back("model.base", toml_string(base));
  f.emplace_back("model.tokenizer", toml_string(tokenizer));
  f.emplace_back("model.chat_template", toml_string(chat_template));
  flat_model(arch, f);
  f.emplace_back("train.steps", i(steps));
  f.emplace_back("train.grad_clip", toml_double(grad_clip));
  f.emplace_back("train.max_bad_steps", i(max_bad_steps));
  flat_optimizer(optimizer, schedule, f);
  f.emplace_back("eval.interval", i(eval_interval));
  f.emplace_back("checkpoint.interval", i(checkpoint_interval));
  f.emplace_back("checkpoint.keep", i(keep_checkpoints));
  f.emplace_back("metrics.tensorboard", b(tensorboard));
  f.emplace_back("metrics.log_interval", i(log_interval));
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
