#include "train/config.h"

#include <toml++/toml.h>

#include <array>
#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <regex>
#include <sstream>

#include "base/config.h"
#include "base/error.h"
#include "base/files.h"
#include "train/toml_text.h"

namespace pollen::train {

std::string toml_text(const toml::node& node) {
  constexpr auto flags =
      toml::toml_formatter::default_flags &
      ~(toml::format_flags::allow_multi_line_strings | toml::format_flags::allow_literal_strings);
  std::ostringstream out;
  out << toml::toml_formatter(node, flags);
  return out.str();
}

std::string toml_string(const std::string& s) {
  return toml_text(toml::value<std::string>(s));
}

std::string toml_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  // The shortest text that reads back as v (3e-3 as 0.003, not 0.0030000000000000001), kept a
  // TOML float: an integral value gets its ".0".
  std::array<char, 32> buf{};
  const auto [end, ec] = std::to_chars(buf.data(), buf.data() + buf.size(), v);
  std::string out(buf.data(), end);
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

std::string toml_strings(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + toml_string(v[i]);
  return s + "]";
}

std::string toml_doubles(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + toml_double(v[i]);
  return s + "]";
}

namespace {

// The key of a --set assignment, without the spaces TOML allows around '=' ('train.steps = 100'
// sets train.steps); empty when there is none.
std::string override_key(const std::string& assignment) {
  std::string key = assignment.substr(0, assignment.find('='));
  const size_t first = key.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return key.substr(first, key.find_last_not_of(" \t") - first + 1);
}

void apply_override(toml::table& root, const std::string& assignment) {
  const auto eq = assignment.find('=');
  const std::string key = override_key(assignment);
  POLLEN_CHECK(eq != std::string::npos && !key.empty(), "--set '", assignment,
               "': expected key=value (for example train.steps=100)");
  const std::string value = assignment.substr(eq + 1);
  toml::table holder;
  try {
    holder = toml::parse("v = " + value);
  } catch (const toml::parse_error& e) {
    // A bare word is a string (run.name=7b-run, 1.5.0, E2); a number in TOML's form that does
    // not parse (an integer past 64 bits) is an error, not that text.
    static const std::regex number_form(R"([+-]?[0-9][0-9_]*(\.[0-9][0-9_]*)?([eE][+-]?[0-9_]+)?)");
    const bool number = std::regex_match(value, number_form);
    POLLEN_CHECK(!number, "--set '", assignment, "': the value is not a number TOML can hold (",
                 e.description(), ")");
    holder = toml::table{};
    holder.insert("v", value);
  }
  // Walk the dotted key, creating tables on the way.
  toml::table* t = &root;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? dot : dot - start);
    POLLEN_CHECK(!part.empty(), "--set '", assignment, "': empty part in key '", key, "'");
    if (dot == std::string::npos) {
      t->insert_or_assign(part, *holder.get("v"));
      return;
    }
    toml::node* n = t->get(part);
    if (!n) {
      t->insert(part, toml::table{});
      n = t->get(part);
    }
    POLLEN_CHECK(n->is_table(), "--set '", assignment, "': '", key.substr(0, dot),
                 "' is not a table");
    t = n->as_table();
    start = dot + 1;
  }
}

}  // namespace

std::pair<std::string, std::string> apply_overrides(const std::string& text,
                                                    const std::string& source,
                                                    const std::vector<std::string>& overrides) {
  if (overrides.empty()) return {text, source};
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail("config file '", source, "': ", e.description(), " at line ", e.source().begin.line,
         ", column ", e.source().begin.column);
  }
  for (const auto& o : overrides) apply_override(root, o);
  const std::string rewritten = toml_text(root);
  // Errors name the keys set over the file (by --set, or by the command: --device, a silo's
  // data), not only "--set", which the user may not have given.
  std::string keys;
  for (const auto& o : overrides) keys += (keys.empty() ? "" : ", ") + override_key(o);
  return {rewritten, cat(source, " with ", keys, " set")};
}

std::string read_config_file(const std::filesystem::path& path) {
  POLLEN_CHECK(!std::filesystem::is_directory(path), "config file '", path.string(),
               "' is a folder; expected a TOML run file");
  try {
    return read_file(path);
  } catch (const Error& e) {
    fail("cannot read config file '", path.string(), "': ", e.what());
  }
}

std::string resolve_config_path(const std::filesystem::path& base_dir, const std::string& p) {
  const std::filesystem::path path(p);
  return base_dir.empty() || path.is_absolute() ? p : (base_dir / path).lexically_normal().string();
}

void read_run_keys(ConfigTable* run, const std::string& source,
                   const std::filesystem::path& base_dir, LoopSettings& c) {
  const std::string stem = std::filesystem::path(source).stem().string();
  c.name = run ? run->get_string("name", stem) : stem;
  // The default is in the current folder, recorded as absolute like the paths of the run file,
  // so that the run folder's config.toml and summary.json name it from wherever they are read.
  c.dir = run && run->has("dir")
              ? resolve_config_path(base_dir, run->get_string("dir", ""))
              : (std::filesystem::absolute("runs") / c.name).lexically_normal().string();
  if (!run) return;
  const int64_t seed = run->get_int("seed", 0);
  POLLEN_CHECK(seed >= 0, run->where("seed"), ": expected a non-negative integer");
  c.seed = static_cast<uint64_t>(seed);
  c.threads = static_cast<int>(run->get_int_in("threads", 0, 0, kConfigThreadsMax));
}

void read_train_keys(ConfigTable& train, LoopSettings& c) {
  c.steps = train.require_int("steps");
  POLLEN_CHECK(c.steps > 0, train.where("steps"), ": expected a positive integer");
  c.grad_clip = train.get_double("grad_clip", 1.0);
  POLLEN_CHECK(c.grad_clip >= 0, train.where("grad_clip"), ": expected 0 (off) or more");
  c.max_bad_steps = train.get_int("max_bad_steps", 5);
  POLLEN_CHECK(c.max_bad_steps > 0, train.where("max_bad_steps"), ": expected 1 or more");
}

void read_eval_keys(ConfigTable& e, LoopSettings& c) {
  c.eval_interval = e.get_int("interval", 0);
  POLLEN_CHECK(c.eval_interval >= 0, e.where("interval"), ": expected 0 (end only) or more, got ",
               c.eval_interval);
}

void read_checkpoint(ConfigTable& k, LoopSettings& c) {
  c.checkpoint_interval = k.get_int("interval", 0);
  POLLEN_CHECK(c.checkpoint_interval >= 0, k.where("interval"),
               ": expected 0 (end only) or more, got ", c.checkpoint_interval);
  c.keep_checkpoints = static_cast<int>(k.get_int_in("keep", 3, 0, INT32_MAX));  // 0: all
  k.finish();
}

void read_metrics_keys(ConfigTable& m, LoopSettings& c) {
  c.tensorboard = m.get_bool("tensorboard", true);
  c.log_interval = m.get_int("log_interval", 10);
  POLLEN_CHECK(c.log_interval > 0, m.where("log_interval"), ": expected 1 or more");
}

void flat_run(const LoopSettings& c, std::vector<std::pair<std::string, std::string>>& f) {
  f.emplace_back("run.name", toml_string(c.name));
  f.emplace_back("run.dir", toml_string(c.dir.string()));
  f.emplace_back("run.seed", std::to_string(c.seed));
  f.emplace_back("run.threads", std::to_string(c.threads));
}

void flat_checkpoint_metrics(const LoopSettings& c,
                             std::vector<std::pair<std::string, std::string>>& f) {
  f.emplace_back("checkpoint.interval", std::to_string(c.checkpoint_interval));
  f.emplace_back("checkpoint.keep", std::to_string(c.keep_checkpoints));
  f.emplace_back("metrics.tensorboard", c.tensorboard ? "true" : "false");
  f.emplace_back("metrics.log_interval", std::to_string(c.log_interval));
}

optim::AdamWOptions OptimizerSettings::adamw(double max_grad_norm) const {
  optim::AdamWOptions o;
  o.lr = lr;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.max_grad_norm = max_grad_norm;
  return o;
}

void read_optimizer_keys(ConfigTable& o, OptimizerSettings& s) {
  s.lr = o.get_double("lr", s.lr);
  s.beta1 = o.get_double("beta1", s.beta1);
  s.beta2 = o.get_double("beta2", s.beta2);
  s.eps = o.get_double("eps", s.eps);
  s.weight_decay = o.get_double("weight_decay", s.weight_decay);
  if (o.has("no_decay")) s.no_decay = o.get_strings("no_decay");
  for (const auto& g : s.no_decay)
    POLLEN_CHECK(g == "norms" || g == "biases" || g == "embeddings", o.where("no_decay"),
                 ": unknown group '", g, "'; expected norms, biases or embeddings");
  // lr = 0 is allowed: a run that samples, evaluates and logs without moving the weights is the
  // baseline a learning run is compared with.
  POLLEN_CHECK(s.lr >= 0, o.where("lr"), ": expected 0 (weights unchanged) or more");
  POLLEN_CHECK(s.beta1 >= 0 && s.beta1 < 1, o.where("beta1"), ": expected [0, 1)");
  POLLEN_CHECK(s.beta2 >= 0 && s.beta2 < 1, o.where("beta2"), ": expected [0, 1)");
  POLLEN_CHECK(s.eps > 0, o.where("eps"), ": expected a positive number");
  POLLEN_CHECK(s.weight_decay >= 0, o.where("weight_decay"), ": expected 0 or more");
}

void read_optimizer(ConfigTable& o, OptimizerSettings& s) {
  read_optimizer_keys(o, s);
  o.finish();
}

int read_zero_key(ConfigTable& p) {
  const int64_t zero = p.get_int("zero", 0);
  POLLEN_CHECK(zero == 0 || zero == 1, p.where("zero"),
               ": expected 0 (replicated optimizer state) or 1 (sharded, ZeRO-1)");
  return static_cast<int>(zero);
}

void read_reduction_keys(ConfigTable& p, double& bucket_mb, double& timeout_s) {
  bucket_mb = p.get_double("bucket_mb", bucket_mb);
  constexpr double kMaxBucketMb = 4096;
  // The trainer truncates bucket_mb * 2^20 to whole bytes: at least one f32 gradient, and far
  // below where that overflows (and below MPI's int count of 2^31 floats, 8 GiB).
  POLLEN_CHECK(bucket_mb * 1048576.0 >= 4.0 && bucket_mb <= kMaxBucketMb, p.where("bucket_mb"),
               ": expected 4 bytes (one f32 gradient, ", 4.0 / 1048576.0, " MiB) to ", kMaxBucketMb,
               " MiB, got ", bucket_mb);
  timeout_s = p.get_double("timeout_s", timeout_s);
  POLLEN_CHECK(timeout_s > 0, p.where("timeout_s"), ": expected a positive number of seconds");
}

void read_schedule(ConfigTable& s, optim::Schedule& schedule) {
  try {
    schedule.kind = optim::parse_schedule_kind(s.get_string("kind", "cosine"));
  } catch (const Error& e) {
    fail(s.where("kind"), ": ", e.what());
  }
  schedule.warmup_steps = s.get_int("warmup_steps", 0);
  POLLEN_CHECK(schedule.warmup_steps >= 0, s.where("warmup_steps"), ": expected 0 or more");
  schedule.min_lr = s.get_double("min_lr", 0.0);
  POLLEN_CHECK(schedule.min_lr >= 0 && schedule.min_lr <= schedule.lr, s.where("min_lr"),
               ": expected 0 to optimizer.lr (", schedule.lr, ")");
  schedule.decay_fraction = s.get_double("decay_fraction", 0.2);
  POLLEN_CHECK(schedule.decay_fraction >= 0 && schedule.decay_fraction <= 1,
               s.where("decay_fraction"), ": expected 0 to 1");
  s.finish();
}

void flat_optimizer(const OptimizerSettings& o, const optim::Schedule& s,
                    std::vector<std::pair<std::string, std::string>>& f) {
  f.emplace_back("optimizer.lr", toml_double(o.lr));
  f.emplace_back("optimizer.beta1", toml_double(o.beta1));
  f.emplace_back("optimizer.beta2", toml_double(o.beta2));
  f.emplace_back("optimizer.eps", toml_double(o.eps));
  f.emplace_back("optimizer.weight_decay", toml_double(o.weight_decay));
  f.emplace_back("optimizer.no_decay", toml_strings(o.no_decay));
  f.emplace_back("schedule.kind", toml_string(optim::schedule_kind_name(s.kind)));
  f.emplace_back("schedule.warmup_steps", std::to_string(s.warmup_steps));
  f.emplace_back("schedule.min_lr", toml_double(s.min_lr));
  f.emplace_back("schedule.decay_fraction", toml_double(s.decay_fraction));
}

void flat_model(const model::LlamaConfig& m, std::vector<std::pair<std::string, std::string>>& f) {
  auto i = [](int64_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  f.emplace_back("model.name", toml_string(m.name));
  f.emplace_back("model.vocab_size", i(m.vocab_size));
  f.emplace_back("model.hidden_size", i(m.hidden_size));
  f.emplace_back("model.intermediate_size", i(m.intermediate_size));
  f.emplace_back("model.num_hidden_layers", i(m.num_hidden_layers));
  f.emplace_back("model.num_attention_heads", i(m.num_attention_heads));
  f.emplace_back("model.num_key_value_heads", i(m.num_key_value_heads));
  f.emplace_back("model.head_dim", i(m.head_dim));
  f.emplace_back("model.max_position_embeddings", i(m.max_position_embeddings));
  f.emplace_back("model.rope_theta", toml_double(m.rope_theta));
  f.emplace_back("model.rms_norm_eps", toml_double(m.rms_norm_eps));
  f.emplace_back("model.tie_word_embeddings", b(m.tie_word_embeddings));
  f.emplace_back("model.attention_bias", b(m.attention_bias));
  f.emplace_back("model.initializer_range", toml_double(m.initializer_range));
  // Written when set (an HF base's), so that a checkpoint is the model it trained; older
  // checkpoints, which lack them, still compare equal on resume.
  if (m.sliding_window > 0) f.emplace_back("model.sliding_window", i(m.sliding_window));
  const ops::RopeScaling& r = m.rope_scaling;
  if (r.kind != ops::RopeScaling::Kind::none) {
    f.emplace_back("model.rope_scaling.kind", toml_string(model::rope_scaling_kind_name(r.kind)));
    f.emplace_back("model.rope_scaling.factor", toml_double(r.factor));
    f.emplace_back("model.rope_scaling.low_freq_factor", toml_double(r.low_freq_factor));
    f.emplace_back("model.rope_scaling.high_freq_factor", toml_double(r.high_freq_factor));
    f.emplace_back("model.rope_scaling.original_max_position_embeddings",
                   i(r.original_max_position_embeddings));
    f.emplace_back("model.rope_scaling.attention_factor", toml_double(r.attention_factor));
    f.emplace_back("model.rope_scaling.beta_fast", toml_double(r.beta_fast));
    f.emplace_back("model.rope_scaling.beta_slow", toml_double(r.beta_slow));
  }
}

std::string flat_to_toml(const std::vector<std::pair<std::string, std::string>>& flat,
                         const std::string& header) {
  std::string out = header;
  std::string section;
  for (const auto& [key, value] : flat) {
    const auto dot = key.find('.');
    const std::string s = key.substr(0, dot);
    if (s != section) {
      out += "\n[" + s + "]\n";
      section = s;
    }
    out += key.substr(dot + 1) + " = " + value + "\n";
  }
  return out;
}

TrainConfig parse_train_config(const std::string& text, const std::string& source,
                               const std::vector<std::string>& overrides,
                               const std::filesystem::path& base_dir) {
  auto resolve = [&](const std::string& p) { return resolve_config_path(base_dir, p); };
  const auto [effective, name] = apply_overrides(text, source, overrides);
  ConfigTable t = ConfigTable::parse(effective, name);
  TrainConfig c;

  auto run = t.table("run");
  read_run_keys(run ? &*run : nullptr, source, base_dir, c);
  if (run) {
    c.device = run->get_string("device", "cpu");
    POLLEN_CHECK(c.device == "cpu" || c.device == "cuda", run->where("device"),
                 ": expected \"cpu\" or \"cuda\", got \"", c.device, "\"");
    c.precision = run->get_string("precision", "f32");
    POLLEN_CHECK(c.precision == "f32" || c.precision == "bf16", run->where("precision"),
                 ": expected \"f32\" or \"bf16\" (bf16 compute with f32 master weights, on ",
                 "the GPU), got \"", c.precision, "\"");
    POLLEN_CHECK(c.precision == "f32" || c.device == "cuda", run->where("precision"),
                 ": run.precision = \"", c.precision,
                 "\" needs run.device = \"cuda\": the CPU trains in f32");
    run->finish();
  }

  auto model = t.table("model");
  POLLEN_CHECK(model.has_value(), "config file '", name, "': missing [model] (preset or file)");
  c.init_from = model->get_string("init_from", "");
  if (!c.init_from.empty()) c.init_from = resolve(c.init_from);
  if (model->has("file")) {
    model::check_model_file_stands_alone(*model);
    const std::string file = model->get_string("file", "");
    model->finish();
    c.model = model::load_config(resolve(file));
  } else {
    c.model = model::read_config(*model);
  }

  auto data = t.table("data");
  POLLEN_CHECK(data.has_value(), "config file '", name, "': missing [data] (manifests)");
  c.manifests = data->get_strings("manifests");
  for (auto& m : c.manifests) m = resolve(m);
  POLLEN_CHECK(!c.manifests.empty(), data->where("manifests"),
               ": missing; expected an array of manifest.json paths");
  c.weights = data->get_doubles("weights");
  POLLEN_CHECK(c.weights.empty() || c.weights.size() == c.manifests.size(), data->where("weights"),
               ": ", c.weights.size(), " weights for ", c.manifests.size(), " manifests");
  for (double w : c.weights)
    POLLEN_CHECK(w > 0, data->where("weights"), ": weights must be positive");
  c.train_split = data->get_string("train_split", "train");
  c.validation_split = data->get_string("validation_split", "validation");
  c.validation_manifests = data->get_strings("validation_manifests");
  for (auto& m : c.validation_manifests) m = resolve(m);
  if (c.validation_manifests.empty()) c.validation_manifests = c.manifests;
  data->finish();

  auto train = t.table("train");
  POLLEN_CHECK(train.has_value(), "config file '", name, "': missing [train] (steps)");
  read_train_keys(*train, c);
  c.micro_batch = train->get_int("micro_batch", 8);
  POLLEN_CHECK(c.micro_batch > 0 && c.micro_batch <= (int64_t{1} << 24),
               train->where("micro_batch"), ": expected 1 to 2^24 sequences");
  c.seq = train->get_int("seq", 128);
  POLLEN_CHECK(c.seq > 0 && c.seq <= c.model.max_position_embeddings, train->where("seq"),
               ": expected 1 to max_position_embeddings (", c.model.max_position_embeddings, ")");
  c.batch_tokens = train->get_int("batch_tokens", c.micro_batch * c.seq);
  // micro_batch * seq cannot overflow: both are at most 2^24 (seq through
  // max_position_embeddings).
  POLLEN_CHECK(c.batch_tokens > 0 && c.batch_tokens % (c.micro_batch * c.seq) == 0,
               train->where("batch_tokens"), ": expected a positive multiple of micro_batch * ",
               "seq (", c.micro_batch * c.seq, "), got ", c.batch_tokens);
  c.recompute = train->get_bool("recompute", false);
  train->finish();

  if (auto o = t.table("optimizer")) read_optimizer(*o, c.optimizer);
  c.schedule.lr = c.optimizer.lr;
  c.schedule.total_steps = c.steps;
  c.schedule.min_lr = 0;
  if (auto s = t.table("schedule")) read_schedule(*s, c.schedule);

  if (auto e = t.table("eval")) {
    read_eval_keys(*e, c);
    c.eval_batches = e->get_int("batches", 8);
    POLLEN_CHECK(c.eval_batches >= 0, e->where("batches"), ": expected 0 (off) or more");
    e->finish();
  }
  if (auto sm = t.table("samples")) {
    c.sample_prompts = sm->get_strings("prompts");
    c.sample_max_tokens = sm->get_int("max_tokens", 32);
    POLLEN_CHECK(c.sample_max_tokens > 0, sm->where("max_tokens"), ": expected 1 or more");
    c.sample_temperature = sm->get_double("temperature", 0.8);
    POLLEN_CHECK(c.sample_temperature >= 0, sm->where("temperature"),
                 ": expected 0 (greedy) or more");
    c.sample_top_k = sm->get_int("top_k", 0);
    POLLEN_CHECK(c.sample_top_k >= 0, sm->where("top_k"), ": expected 0 (off) or more");
    const int64_t seed = sm->get_int("seed", 0);
    POLLEN_CHECK(seed >= 0, sm->where("seed"), ": expected a non-negative integer");
    c.sample_seed = static_cast<uint64_t>(seed);
    const std::string tokenizer = sm->get_string("tokenizer", "");
    if (!tokenizer.empty()) c.sample_tokenizer = resolve(tokenizer);
    sm->finish();
  }
  if (auto k = t.table("checkpoint")) read_checkpoint(*k, c);
  if (auto m = t.table("metrics")) {
    read_metrics_keys(*m, c);
    c.peak_flops = m->get_double("peak_flops", 0.0);
    POLLEN_CHECK(c.peak_flops >= 0, m->where("peak_flops"), ": expected 0 (measure) or more");
    m->finish();
  }
  if (auto p = t.table("parallel")) {
    c.zero = read_zero_key(*p);
    read_reduction_keys(*p, c.bucket_mb, c.timeout_s);
    p->finish();
  }
  if (auto p = t.table("privacy")) c.privacy = read_dp_sgd(*p);
  t.finish();
  return c;
}

optim::DpSgdOptions read_dp_sgd(ConfigTable& t) {
  optim::DpSgdOptions o;
  o.enabled = true;
  o.clip = t.require_double("clip");
  POLLEN_CHECK(std::isfinite(o.clip) && o.clip > 0, t.where("clip"),
               ": expected a positive per-sequence gradient norm, got ", o.clip);
  POLLEN_CHECK(t.has("noise_multiplier") != t.has("target_epsilon"), t.where("noise_multiplier"),
               ": give either noise_multiplier (the noise's std over clip) or target_epsilon (the ",
               "epsilon the last step should reach, which sets the noise), one of them",
               t.near_miss("noise_multiplier"), t.near_miss("target_epsilon"));
  o.noise_multiplier = t.get_double("noise_multiplier", 0);
  POLLEN_CHECK(std::isfinite(o.noise_multiplier) && o.noise_multiplier >= 0,
               t.where("noise_multiplier"), ": expected 0 or more, got ", o.noise_multiplier);
  o.target_epsilon = t.get_double("target_epsilon", 0);
  POLLEN_CHECK(
      !t.has("target_epsilon") || (std::isfinite(o.target_epsilon) && o.target_epsilon > 0),
      t.where("target_epsilon"), ": expected a positive epsilon, got ", o.target_epsilon);
  o.delta = t.get_double("delta", 0);
  POLLEN_CHECK(!t.has("delta") || (o.delta > 0 && o.delta < 1), t.where("delta"),
               ": expected a value in (0, 1), got ", o.delta);
  if (t.has("noise_seed")) o.noise_seed = t.get_int_in("noise_seed", 0, 0, kConfigIntMax);
  o.secure_noise = t.get_bool("secure_noise", false);
  t.finish();
  return o;
}

void check_manifests_exist(const TrainConfig& c, const std::string& source) {
  for (const auto* key : {"manifests", "validation_manifests"})
    for (const auto& m : std::string(key) == "manifests" ? c.manifests : c.validation_manifests)
      POLLEN_CHECK(std::filesystem::is_regular_file(m), "config file '", source, "', key 'data.",
                   key, "': '", m, "' does not exist (expected the manifest.json of a dataset ",
                   "made by pollen data prepare)");
}

TrainConfig load_train_config(const std::filesystem::path& path,
                              const std::vector<std::string>& overrides) {
  // Paths resolve against the run file's absolute folder: the run folder's config.toml then names
  // its data and init_from wherever a later command runs from.
  return parse_train_config(read_config_file(path), path.string(), overrides,
                            std::filesystem::absolute(path).parent_path());
}

std::vector<std::pair<std::string, std::string>> TrainConfig::flat() const {
  std::vector<std::pair<std::string, std::string>> f;
  auto i = [](int64_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  flat_run(*this, f);
  f.emplace_back("run.device", toml_string(device));
  f.emplace_back("run.precision", toml_string(precision));
  flat_model(model, f);
  f.emplace_back("model.init_from", toml_string(init_from));
  f.emplace_back("data.manifests", toml_strings(manifests));
  f.emplace_back("data.weights", toml_doubles(weights));
  f.emplace_back("data.train_split", toml_string(train_split));
  f.emplace_back("data.validation_split", toml_string(validation_split));
  f.emplace_back("data.validation_manifests", toml_strings(validation_manifests));
  f.emplace_back("train.steps", i(steps));
  f.emplace_back("train.batch_tokens", i(batch_tokens));
  f.emplace_back("train.micro_batch", i(micro_batch));
  f.emplace_back("train.seq", i(seq));
  f.emplace_back("train.grad_clip", toml_double(grad_clip));
  f.emplace_back("train.max_bad_steps", i(max_bad_steps));
  f.emplace_back("train.recompute", b(recompute));
  flat_optimizer(optimizer, schedule, f);
  f.emplace_back("eval.interval", i(eval_interval));
  f.emplace_back("eval.batches", i(eval_batches));
  f.emplace_back("samples.prompts", toml_strings(sample_prompts));
  f.emplace_back("samples.max_tokens", i(sample_max_tokens));
  f.emplace_back("samples.temperature", toml_double(sample_temperature));
  f.emplace_back("samples.top_k", i(sample_top_k));
  f.emplace_back("samples.seed", i(static_cast<int64_t>(sample_seed)));
  f.emplace_back("samples.tokenizer", toml_string(sample_tokenizer));
  flat_checkpoint_metrics(*this, f);
  f.emplace_back("metrics.peak_flops", toml_double(peak_flops));
  f.emplace_back("parallel.zero", i(zero));
  f.emplace_back("parallel.bucket_mb", toml_double(bucket_mb));
  f.emplace_back("parallel.timeout_s", toml_double(timeout_s));
  if (privacy.enabled) {
    f.emplace_back("privacy.clip", toml_double(privacy.clip));
    if (privacy.target_epsilon > 0) {
      f.emplace_back("privacy.target_epsilon", toml_double(privacy.target_epsilon));
    } else {
      f.emplace_back("privacy.noise_multiplier", toml_double(privacy.noise_multiplier));
    }
    if (privacy.delta > 0) f.emplace_back("privacy.delta", toml_double(privacy.delta));
    if (privacy.noise_seed >= 0) f.emplace_back("privacy.noise_seed", i(privacy.noise_seed));
    f.emplace_back("privacy.secure_noise", privacy.secure_noise ? "true" : "false");
  }
  return f;
}

std::string TrainConfig::to_toml() const {
  return flat_to_toml(flat(),
                      "# Resolved by pollen train: every key with the value the run used.\n");
}

bool key_may_change_on_resume(const std::string& key) {
  return key == "run.name" || key == "run.dir" || key == "run.threads" || key == "run.device" ||
         key == "run.precision" || key == "train.steps" || key == "train.max_bad_steps" ||
         key == "train.micro_batch" || key == "privacy.secure_noise" || key.starts_with("eval.") ||
         key.starts_with("samples.") || key.starts_with("checkpoint.") ||
         key.starts_with("metrics.") || key.starts_with("parallel.");
}

bool same_setting(const std::string& a, const std::string& b) {
  if (a == b) return true;
  // Whole numbers compare exactly (seeds past 2^53 would be one double); otherwise as doubles.
  const auto whole = [](const std::string& text) -> std::optional<int64_t> {
    int64_t v = 0;
    const char* end = text.data() + text.size();
    const auto [stop, error] = std::from_chars(text.data(), end, v);
    if (text.empty() || error != std::errc() || stop != end) return std::nullopt;
    return v;
  };
  const auto number = [](const std::string& text) -> std::optional<double> {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) return std::nullopt;
    return v;
  };
  if (const auto x = whole(a), y = whole(b); x && y) return *x == *y;
  const auto x = number(a), y = number(b);
  return x && y && *x == *y;
}

std::string changed_settings(const std::vector<std::pair<std::string, std::string>>& saved,
                             const std::vector<std::pair<std::string, std::string>>& now) {
  const std::map<std::string, std::string> before(saved.begin(), saved.end()),
      after(now.begin(), now.end());
  std::string changes;
  const auto add = [&](const std::string& change) {
    changes += (changes.empty() ? "" : ", ") + change;
  };
  for (const auto& [key, value] : after) {
    const auto it = before.find(key);
    if (it == before.end())
      add(cat(key, " added (= ", value, ")"));
    else if (!same_setting(it->second, value))
      add(cat(key, " (", it->second, " -> ", value, ")"));
  }
  for (const auto& [key, value] : before)
    if (!after.contains(key)) add(cat(key, " removed (was ", value, ")"));
  return changes;
}

std::vector<std::string> check_resume_compatible(const TrainConfig& saved, const TrainConfig& now) {
  return check_resume_compatible(saved.flat(), now.flat(), "docs/training.md, 'Resuming'");
}

std::vector<std::string> check_resume_compatible(
    const std::vector<std::pair<std::string, std::string>>& saved,
    const std::vector<std::pair<std::string, std::string>>& now, const std::string& doc) {
  const std::map<std::string, std::string> old(saved.begin(), saved.end());
  std::vector<std::string> warnings;
  std::string refused;
  for (const auto& [key, value] : now) {
    const auto it = old.find(key);
    if (it == old.end() || same_setting(it->second, value)) continue;
    const std::string change = cat(key, " (", it->second, " -> ", value, ")");
    if (!key_may_change_on_resume(key)) {
      refused += (refused.empty() ? "" : ", ") + change;
    } else if (key == "train.steps") {
      warnings.push_back(cat(change, ": the schedule now ends at the new step count, so the ",
                             "learning rate differs from the checkpointed run's from here on"));
    } else if (key == "train.micro_batch") {
      // Validation reads eval.batches micro-batches: as many windows as before take another count.
      const auto eval_batches = [](const auto& entries) -> int64_t {
        for (const auto& [k, v] : entries)
          if (k == "eval.batches") return std::stoll(v);
        return 0;
      };
      const int64_t windows_before = eval_batches(saved) * std::stoll(it->second),
                    after = std::stoll(value), windows_now = eval_batches(now) * after;
      std::string validation;
      if (windows_now > 0 && windows_now != windows_before)
        validation = cat("; validation now scores up to ", windows_now, " windows against up to ",
                         windows_before,
                         windows_before % after == 0
                             ? cat(" (--set eval.batches=", windows_before / after, " keeps them)")
                             : std::string(),
                         ", a split of fewer being scored whole");
      warnings.push_back(cat(change, ": a step still trains on train.batch_tokens, so the run ",
                             "continues to rounding, not bitwise", validation));
    } else if (key == "run.threads" && it->second == "0") {
      // A checkpoint of an older pollen recorded "all" as 0: the count it ran is not known.
    } else if (key == "run.threads" || key == "run.device" || key == "run.precision") {
      warnings.push_back(cat(change,
                             ": a different thread count, device or precision gives results ",
                             "that agree to rounding, not bitwise"));
    }
  }
  // Keys on one side only are a newer pollen's (a checkpoint written before them), except the
  // adapters' and the model's: LoRA added or removed changes what the checkpoint holds, and the
  // model's keys written only when set (a sliding window, rope scaling) change its attention.
  const auto one_sided_refused = [](const std::string& key) {
    return key.starts_with("lora.") || key.starts_with("model.");
  };
  const std::map<std::string, std::string> current(now.begin(), now.end());
  for (const auto& [key, value] : old)
    if (one_sided_refused(key) && !current.count(key))
      refused += cat(refused.empty() ? "" : ", ", key, " (", value, " -> none)");
  for (const auto& [key, value] : now)
    if (one_sided_refused(key) && !old.count(key))
      refused += cat(refused.empty() ? "" : ", ", key, " (none -> ", value, ")");
  POLLEN_CHECK(refused.empty(), "cannot resume: these keys differ from the checkpoint's config ",
               "and may not change in a resumed run: ", refused, " (see ", doc, ")");
  return warnings;
}

}  // namespace pollen::train
