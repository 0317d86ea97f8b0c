// The server's checkpoint: everything a resumed run needs (global weights, the strategy's and
// privacy accountant's state, the shared moments, the clients' view, the lineage, the metrics
// files' positions), written after each aggregated round and read back on --resume.
#include "fed/coordinator.h"

#include <algorithm>

#include "base/files.h"
#include "base/json_depth.h"
#include "base/log.h"
#include "fed/first_moments.h"
#include "fed/post_lora.h"
#include "fed/second_moments.h"
#include "io/checkpoint.h"
#include "io/peft.h"
#include "train/config.h"

namespace pollen::fed {

namespace fs = std::filesystem;

void Coordinator::load_checkpoint(const fs::path& dir) {
  const auto state = nlohmann::json::parse(read_file(dir / "state.json"));
  // Keys a checkpoint of an older pollen did not record (sliding_window and rope_scaling before
  // protocol 15) cannot be compared: the others must agree.
  const auto saved = nlohmann::json::parse(state.at("model_config").get<std::string>());
  const auto now = nlohmann::json::parse(terms_.model_json);
  std::string differs;
  for (const auto& [key, value] : saved.items()) {
    const std::string here = now.contains(key) ? now[key].dump() : "(none)";
    if (here != value.dump())
      differs += cat(differs.empty() ? "" : ", ", "model.", key, ": checkpoint ", value.dump(),
                     ", config ", here);
  }
  POLLEN_CHECK(differs.empty(), "fed server: checkpoint ", dir.string(),
               " holds another model than the config's [model]: ", differs);
  const auto fingerprint = state.at("tokenizer_fingerprint").get<std::string>();
  POLLEN_CHECK(fingerprint == config_.tokenizer_fingerprint, "fed server: checkpoint ",
               dir.string(), " was trained with tokenizer fingerprint ", fingerprint,
               ", the config says ", config_.tokenizer_fingerprint,
               " ([tokenizer]): its weights belong to the other tokenizer's ids");
  POLLEN_CHECK(state.at("strategy").get<std::string>() == strategy_->name(),
               "fed server: checkpoint ", dir.string(), " was written by strategy '",
               state.at("strategy").get<std::string>(), "', the config says '", strategy_->name(),
               "'");
  // A post-training checkpoint of another objective holds other tensors (a reward model's head).
  if (state.contains("post_objective")) {
    const std::string objective = state.at("post_objective").get<std::string>();
    POLLEN_CHECK(objective == terms_.post_objective, "fed server: checkpoint ", dir.string(),
                 " was written by a federation of post.objective '", objective,
                 "', the config says '", terms_.post_objective, "'");
  }
  // Before the tensors: another LoRA rank or targets gives them other shapes, and the error
  // should name the key that changed.
  const std::string lora_json = state.value("lora_config", std::string());
  POLLEN_CHECK(lora_json.empty() == terms_.lora_json.empty(), "fed server: checkpoint ",
               dir.string(),
               terms_.lora_json.empty() ? " holds LoRA adapters, the config trains the whole model"
                                        : " holds a whole model, the config trains LoRA adapters");
  if (!lora_json.empty() && lora_json != terms_.lora_json) {
    const std::string what = cat("fed server: checkpoint ", dir.string());
    fail(what, " holds adapters of another LoRA config than post.run's: ",
         lora_agreement_differences(parse_lora_config_json(lora_json, what),
                                    parse_lora_config_json(terms_.lora_json, "post.run's [lora]"),
                                    {"checkpoint", "post.run"}));
  }
  POLLEN_CHECK(state.value("base_sha256", std::string()) == terms_.base_sha256,
               "fed server: checkpoint ", dir.string(),
               " was trained on another base model than post.run's (its weights' SHA-256 differ)");
  const auto model = io::read_safetensors(dir / "model.safetensors");
  POLLEN_CHECK(model.tensors.size() == specs_.size(), "fed server: ", dir.string(),
               "/model.safetensors has ", model.tensors.size(), " tensors, the model ",
               specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    const Tensor* t = model.find(specs_[i].name);
    POLLEN_CHECK(t && t->shape() == specs_[i].shape, "fed server: ", dir.string(),
                 "/model.safetensors: tensor '", specs_[i].name,
                 "' is missing or has another shape");
    global_[i] = t->to(DType::f32);
  }
  if (fs::exists(dir / "strategy.safetensors")) {
    strategy_->load_state(io::read_safetensors(dir / "strategy.safetensors").tensors);
  }
  if (config_.strategy.shares_second_moments() && fs::exists(dir / "second_moments.safetensors")) {
    const auto f = io::read_safetensors(dir / "second_moments.safetensors");
    const Tensor* t = f.find("second_moments");
    const std::string what = cat("fed server: ", dir.string(), "/second_moments.safetensors");
    POLLEN_CHECK(t && t->dim() == 1 && t->dtype() == DType::u8, what,
                 ": expected one uint8 vector 'second_moments' (the moments as sent)");
    std::string wire(reinterpret_cast<const char*>(t->data<uint8_t>()),
                     static_cast<size_t>(t->numel()));
    unpack_second_moments(specs_, wire, what);
    second_moments_ = std::move(wire);
  }
  if (!moment_specs_.empty() && fs::exists(dir / "first_moments.safetensors")) {
    const std::string what = cat("fed server: ", dir.string(), "/first_moments.safetensors");
    const auto f = io::read_safetensors(dir / "first_moments.safetensors");
    Weights mean;
    for (const auto& m : moment_specs_) {
      const Tensor* t = f.find(m.name);
      if (!t) break;  // written with other tensors shared (strategy.first_moments changed)
      POLLEN_CHECK(t->shape() == m.shape && t->dtype() == DType::f32, what, ": tensor '", m.name,
                   "' is not float32 of its shape");
      mean.push_back(t->clone());
    }
    if (mean.size() == moment_specs_.size()) {
      check_first_moments(moment_specs_, mean, what);
      set_first_moments(std::move(mean));
    } else {
      log::warn(what, " holds other tensors' moments than strategy.first_moments = '",
                config_.strategy.first_moments, "' shares; the clients start from their own");
    }
  }
  if (publisher_->compressed()) {
    // The model the clients hold; without it (compression turned on at resume) the next round
    // sends the whole model to every client.
    Weights view = clone_weights(global_);
    if (fs::exists(dir / "view.safetensors")) {
      const auto f = io::read_safetensors(dir / "view.safetensors");
      for (size_t i = 0; i < specs_.size(); ++i) {
        const Tensor* t = f.find(specs_[i].name);
        POLLEN_CHECK(t && t->shape() == specs_[i].shape && t->dtype() == DType::f32,
                     "fed server: ", dir.string(), "/view.safetensors: tensor '", specs_[i].name,
                     "' is missing or not float32 of its shape");
        view[i] = t->clone();
      }
    }
    publisher_->restore(std::move(view));
  }
  if (dp_) {
    POLLEN_CHECK(state.contains("privacy"), "fed server: checkpoint ", dir.string(),
                 " was written without [privacy]; its rounds were not accounted for");
    dp_->load_state(state.at("privacy"));
  } else {
    POLLEN_CHECK(!state.contains("privacy"), "fed server: checkpoint ", dir.string(),
                 " was written under [privacy]; resuming without it would release rounds that "
                 "no accountant counts (put the [privacy] table back)");
  }
  done_ = state.at("round").get<int64_t>();
  // A round saved unapplied (its release accounted) goes on at its next attempt: the attempt
  // seeds the round's client sample, which must not be drawn again for another release.
  retries_ = state.value("retries", int64_t{0});
  lineage_ = state.at("lineage");
}

void Coordinator::save_checkpoint(const RoundSummary& s) {
  metrics_.file().sync();
  lineage_file_.file().sync();
  tensorboard_.file().sync();
  io::CheckpointWriter w(config_.dir / "checkpoints", done_);
  io::NamedTensors model;
  for (size_t i = 0; i < specs_.size(); ++i) model.emplace_back(specs_[i].name, global_[i]);
  w.add_tensors("model.safetensors", model, {{"round", std::to_string(done_)}});
  const auto st = strategy_->state();
  if (!st.empty()) w.add_tensors("strategy.safetensors", st);
  if (!second_moments_.empty()) {
    Tensor t = Tensor::empty({static_cast<int64_t>(second_moments_.size())}, DType::u8);
    std::copy(second_moments_.begin(), second_moments_.end(),
              reinterpret_cast<char*>(t.data<uint8_t>()));
    w.add_tensors("second_moments.safetensors", {{"second_moments", t}});
  }
  if (!first_moments_.empty()) {
    io::NamedTensors moments;
    for (size_t i = 0; i < moment_specs_.size(); ++i)
      moments.emplace_back(moment_specs_[i].name, first_moments_[i]);
    w.add_tensors("first_moments.safetensors", moments);
  }
  if (publisher_->compressed()) {
    io::NamedTensors view;
    for (size_t i = 0; i < specs_.size(); ++i)
      view.emplace_back(specs_[i].name, publisher_->view()[i]);
    w.add_tensors("view.safetensors", view);
  }
  nlohmann::ordered_json state{{"round", done_},
                               {"retries", retries_},
                               {"strategy", strategy_->name()},
                               {"model_config", terms_.model_json},
                               {"tokenizer_fingerprint", config_.tokenizer_fingerprint},
                               {"protocol_version", kProtocolVersion},
                               {"metrics_bytes", metrics_.file().position()},
                               {"lineage_bytes", lineage_file_.file().position()},
                               {"tensorboard_file", tensorboard_.file().path().filename().string()},
                               {"tensorboard_bytes", tensorboard_.file().position()},
                               {"lineage", lineage_}};
  if (dp_) state["privacy"] = dp_->state();
  if (!config_.settings.empty()) state["settings"] = config_.settings;
  if (post_global_) {
    state["base_sha256"] = terms_.base_sha256;
    state["lora_config"] = terms_.lora_json;
    state["post_objective"] = terms_.post_objective;
  }
  w.add_text("state.json", state.dump(1));
  if (dp_) write_file_atomic(privacy_ledger_path(), dp_->state().dump(1) + "\n");
  if (!post_global_) {
    // The architecture as [model]: the folder is then a pollen checkpoint that generate, eval,
    // serve and export take as --model (the tokenizer given beside it).
    std::vector<std::pair<std::string, std::string>> flat;
    train::flat_model(config_.model, flat);
    w.add_text("config.toml",
               train::flat_to_toml(flat, cat("# The global model after round ", done_,
                                             " of a pollen fed server (tokenizer fingerprint ",
                                             config_.tokenizer_fingerprint, ").\n")));
  }
  w.commit();
  std::error_code ec;                     // one left behind is stale, and a resume removes it
  fs::remove(privacy_charge_path(), ec);  // the checkpoint holds the round's charge now
  if (post_global_) save_global_adapter();
  io::apply_retention(config_.dir / "checkpoints", config_.keep_checkpoints);
  (void)s;
}

void Coordinator::write_privacy_charge_locked() {
  const size_t selected = selected_.size();
  CentralDp charged = *dp_;
  AggregationReport unused;
  charged.account_distributed(
      static_cast<int64_t>(selected), round_available_, static_cast<int64_t>(secagg_->inputs()),
      secagg_options_locked(selected).noise, distributed_release_rdp_locked(selected), &unused);
  const nlohmann::ordered_json charge{
      {"round", done_ + 1}, {"attempt", retries_}, {"privacy", charged.state()}};
  write_file_atomic(privacy_charge_path(), charge.dump(1) + "\n");
}

namespace {

// A privacy file of the server's folder (the ledger, a round's charge), as its JSON object; none
// when it is absent. Refused without [privacy]: the releases it counts would go on uncounted.
std::optional<nlohmann::json> read_privacy_file(const fs::path& path, bool private_run,
                                                std::string_view holds) {
  if (!fs::exists(path)) return std::nullopt;
  const std::string what = cat("fed server: '", path.string(), "'");
  POLLEN_CHECK(private_run, what, " holds ", holds,
               "; resuming without [privacy] would release rounds that no accountant counts (put "
               "the [privacy] table back)");
  return parse_json_object(read_file(path), what);
}

}  // namespace

void Coordinator::take_privacy_ledger() {
  const fs::path path = privacy_ledger_path();
  const auto ledger = read_privacy_file(path, dp_ != nullptr,
                                        "the privacy account of rounds released under [privacy]");
  if (!ledger) return;
  POLLEN_CHECK(ledger->contains("steps") && (*ledger)["steps"].is_number_integer() &&
                   ledger->contains("rdp"),
               "fed server: '", path.string(),
               "': expected the accountant's state {rdp, steps, ...}");
  const int64_t released = (*ledger)["steps"].get<int64_t>();
  if (released <= dp_->private_rounds()) return;
  log::warn("fed server: ", released - dp_->private_rounds(),
            " private release(s) made after the point this resume starts from stay accounted (",
            path.string(), "); their rounds run again, released anew");
  dp_->load_accounting(*ledger);
}

void Coordinator::take_privacy_charge() {
  const fs::path path = privacy_charge_path();
  const std::string what = cat("fed server: '", path.string(), "'");
  const auto read = read_privacy_file(path, dp_ != nullptr,
                                      "the privacy charge of a round whose shares were revealed");
  if (!read) return;
  const nlohmann::json& charge = *read;
  POLLEN_CHECK(charge.contains("round") && charge["round"].is_number_integer() &&
                   charge.contains("attempt") && charge["attempt"].is_number_integer() &&
                   charge.contains("privacy"),
               what, ": expected {round, attempt, privacy}");
  const auto round = charge["round"].get<int64_t>();
  const auto attempt = charge["attempt"].get<int64_t>();
  if (round <= done_ || (round == done_ + 1 && attempt < retries_)) {
    fs::remove(path);  // written before a checkpoint that holds it
    return;
  }
  POLLEN_CHECK(round == done_ + 1, what, " charges round ", round,
               ", but the newest checkpoint is of round ", done_,
               "; the checkpoints in between are missing");
  dp_->load_state(charge["privacy"]);
  retries_ = attempt + 1;  // that attempt's sample was released
  log::warn("fed server: round ", round, " (attempt ", attempt + 1,
            ") ended after its shares were revealed and before its checkpoint; its release is "
            "accounted (",
            path.string(), "), and the round goes on at its next attempt");
}

void Coordinator::warn_of_changed_settings(const nlohmann::json& state, const fs::path& ckpt) {
  if (config_.settings.empty() || !state.contains("settings") || !state["settings"].is_object())
    return;
  // Keys that leave the trained weights as they are; [model] and [tokenizer] are compared as
  // resolved (load_checkpoint), so a preset written out key by key is the same model.
  static const std::vector<std::string> free_keys = {"server.rounds",
                                                     "server.round_timeout_s",
                                                     "server.wait_for_clients_s",
                                                     "server.client_timeout_s",
                                                     "server.keep_checkpoints",
                                                     "server.max_round_retries",
                                                     "server.address",
                                                     "server.metrics_address",
                                                     "server.allow_plaintext",
                                                     "server.eval_every",
                                                     "server.dir",
                                                     "federation.rounds",
                                                     "federation.output",
                                                     "federation.eval_every",
                                                     "run file: run.name",
                                                     "run file: run.threads",
                                                     "tls.",
                                                     "model.",
                                                     "tokenizer."};
  const auto is_free = [&](const std::string& key) {
    return std::any_of(free_keys.begin(), free_keys.end(), [&](const std::string& f) {
      return f.ends_with('.') ? key.starts_with(f) : key == f;
    });
  };
  std::map<std::string, std::string> saved;
  for (const auto& [key, value] : state["settings"].items())
    if (value.is_string()) saved[key] = value.get<std::string>();
  // A checkpoint of an older pollen holds no run file's keys: they are not compared then.
  const std::string run_file = "run file: ";
  const bool run_file_saved = std::any_of(
      saved.begin(), saved.end(), [&](const auto& kv) { return kv.first.starts_with(run_file); });
  std::string changed;
  const auto add = [&](const std::string& key, const std::string& was, const std::string& now) {
    if (is_free(key) || was == now || (key.starts_with(run_file) && !run_file_saved)) return;
    changed += cat(changed.empty() ? "" : ", ", key, " (", was, " -> ", now, ")");
  };
  for (const auto& [key, was] : saved) {
    const auto it = config_.settings.find(key);
    add(key, was, it == config_.settings.end() ? "left out" : it->second);
  }
  for (const auto& [key, now] : config_.settings)
    if (!saved.count(key)) add(key, "left out", now);
  if (!changed.empty())
    log::warn(config_.command, " --resume: the config differs from that of checkpoint '",
              ckpt.string(), "': ", changed,
              "; the run goes on with the new values, as an uninterrupted run "
              "would not");
}

void Coordinator::save_global_adapter() {
  post_global_->set_weights(global_);
  post_global_->save(config_.dir / "adapter", post_base_);
}

std::filesystem::path Coordinator::export_reward_model() {
  std::lock_guard lock(mutex_);
  POLLEN_CHECK(post_global_ && !post_global_->objective_params().empty(),
               "fed server: only a reward model's federation ([post] objective = \"rm\") exports "
               "a reward model");
  post_global_->set_weights(global_);
  const fs::path dir = config_.dir / "reward_model";
  export_federated_reward_model(train::load_post_config(config_.post.run, config_.post.objective),
                                *post_global_, dir);
  return dir;
}

}  // namespace pollen::fed
