#include "fed/client_state.h"

#include <charconv>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "base/files.h"
#include "base/log.h"
#include "fed/client.h"
#include "fed/post_lora.h"
#include "fed/privacy.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "train/trainer.h"

namespace pollen::fed {

namespace fs = std::filesystem;

namespace {

io::NamedTensors named(const Weights& tensors, const ParamSpecs& specs) {
  io::NamedTensors out;
  for (size_t i = 0; i < tensors.size(); ++i) out.emplace_back(specs[i].name, tensors[i]);
  return out;
}

// Tensors of the exchanged shapes from `file` of a state (none when it has no such file): the
// error-feedback residual, the drift correction's anchor, the pulled model.
Weights read_exchanged(const fs::path& ckpt, const std::string& file, const std::string& client_id,
                       const ParamSpecs& specs) {
  Weights out;
  if (!fs::exists(ckpt / file)) return out;
  const auto f = io::read_safetensors(ckpt / file);
  for (const auto& spec : specs) {
    const Tensor* t = f.find(spec.name);
    POLLEN_CHECK(t && t->shape() == spec.shape && t->dtype() == DType::f32, "fed client '",
                 client_id, "': ", (ckpt / file).string(), ": tensor '", spec.name,
                 "' is missing or not float32 of the exchanged tensors' shape");
    out.push_back(t->clone());
  }
  return out;
}

// Refuses a state of another client, or trained on other data than the client's now.
void check_owner(const nlohmann::json& state, const fs::path& ckpt, const std::string& client_id,
                 const std::string& manifest_hash) {
  const auto owner = state.at("client").get<std::string>();
  POLLEN_CHECK(owner == client_id, "fed client '", client_id, "': state ", ckpt.string(),
               " belongs to client '", owner, "'");
  const auto hash = state.at("data_manifest_hash").get<std::string>();
  POLLEN_CHECK(hash == manifest_hash, "fed client '", client_id, "': state ", ckpt.string(),
               " was trained on data ", hash, ", the config's data is ", manifest_hash,
               "; remove the state folder to start this silo afresh");
}

// A silo whose saved states all fail to verify stops rather than start afresh beside them.
void refuse_if_none_verifies(bool chosen, int64_t skipped, const fs::path& dir,
                             const std::string& client_id) {
  POLLEN_CHECK(chosen || skipped == 0, "fed client '", client_id, "': no saved state under ",
               (dir / "checkpoints").string(), " verifies (", skipped,
               " skipped, reasons above); move the folder away to start this silo afresh");
}

// [local_dp]'s accountant, kept beside the state so that a restarted client reports the epsilon
// of every round it released, not only of those since the restart.
void save_local_dp(const LocalDp* local_dp, nlohmann::ordered_json& state) {
  if (local_dp) state["local_dp"] = local_dp->state();
}

// `saved`: the state's "local_dp" (null when it has none).
void load_local_dp(LocalDp* local_dp, const nlohmann::json* saved, int64_t round,
                   const fs::path& ckpt, const std::string& client_id) {
  if (!local_dp) return;
  POLLEN_CHECK(saved || round == 0, "fed client '", client_id, "': state ", ckpt.string(),
               " of round ", round,
               " holds no [local_dp] privacy account (its rounds ran "
               "without [local_dp], or before the account was kept), so the epsilon of the "
               "rounds released so far is unknown; remove the state folder to start afresh");
  if (saved) local_dp->load_state(*saved);
}

// The push a state is saved before: its round in state.json, the residual from before it beside.
void save_unsettled(const std::optional<UnsettledPush>& unsettled, const ParamSpecs& specs,
                    io::CheckpointWriter& w, nlohmann::ordered_json& state) {
  if (!unsettled) return;
  state["unsettled_push_round"] = unsettled->round;
  if (!unsettled->residual.empty())
    w.add_tensors("feedback_before_push.safetensors", named(unsettled->residual, specs));
}

template <typename Json>
std::optional<UnsettledPush> load_unsettled(const Json& state, const fs::path& ckpt,
                                            const std::string& client_id, const ParamSpecs& specs) {
  if (!state.contains("unsettled_push_round")) return std::nullopt;
  return UnsettledPush{state.at("unsettled_push_round").template get<int64_t>(),
                       read_exchanged(ckpt, "feedback_before_push.safetensors", client_id, specs)};
}

}  // namespace

void save_client_state(const fs::path& dir, int keep, const std::string& client_id, int64_t round,
                       LocalTrainer& trainer, const ParamSpecs& specs,
                       const ErrorFeedback& feedback, const DriftCorrection& drift,
                       const Weights& pulled, const LocalDp* local_dp,
                       const std::optional<UnsettledPush>& unsettled) {
  const auto params = trainer.model().named_parameters();
  const std::vector<Tensor> f32 = trainer.weights();  // the master weights under bf16 compute
  const train::OptimizerMoments opt = trainer.optimizer_moments();
  io::NamedTensors weights, moments;
  const io::NamedTensors residual = named(feedback.residual(), specs);
  for (size_t i = 0; i < params.size(); ++i) {
    weights.emplace_back(params[i].first, f32[i].cpu());
    moments.emplace_back(params[i].first + ".exp_avg", opt.exp_avg[i]);
    moments.emplace_back(params[i].first + ".exp_avg_sq", opt.exp_avg_sq[i]);
  }
  io::CheckpointWriter w(dir / "checkpoints", trainer.steps_taken());
  // The names train::load_checkpoint reads.
  w.add_tensors("model.safetensors", weights);
  w.add_tensors("optimizer.safetensors", moments,
                {{"step", std::to_string(opt.steps)}, {"optimizer", "adamw"}});
  if (!residual.empty()) w.add_tensors("feedback.safetensors", residual);
  if (!pulled.empty()) w.add_tensors("pulled_model.safetensors", named(pulled, specs));
  nlohmann::ordered_json state{{"client", client_id},
                               {"round", round},
                               {"local_steps", trainer.steps_taken()},
                               {"data_manifest_hash", trainer.manifest_hash()},
                               {"loader", trainer.train_loader().state().to_json()}};
  if (!drift.anchor().empty()) {
    w.add_tensors("drift_anchor.safetensors", named(drift.anchor(), specs));
    state["drift_anchor_round"] = drift.anchor_round();
  }
  save_local_dp(local_dp, state);
  save_unsettled(unsettled, specs, w, state);
  w.add_text("state.json", state.dump(1));
  w.commit();
  io::apply_retention(dir / "checkpoints", keep);
}

namespace {

// Restores the state in `ckpt` (on every rank of the trainer); returns its round. local_dp,
// unsettled: null leaves the accountant, the push waiting to be settled, as they are.
int64_t restore_state(const fs::path& ckpt, const std::string& client_id, LocalTrainer& trainer,
                      const ParamSpecs& specs, ErrorFeedback& feedback, DriftCorrection& drift,
                      Weights* pulled, LocalDp* local_dp, std::optional<UnsettledPush>* unsettled) {
  const auto state = nlohmann::json::parse(read_file(ckpt / "state.json"));
  check_owner(state, ckpt, client_id, trainer.manifest_hash());
  trainer.load_checkpoint(ckpt);
  trainer.train_loader().restore(data::LoaderState::from_json(state.at("loader")));
  trainer.set_steps_taken(state.at("local_steps").get<int64_t>());
  const int64_t round = state.at("round").get<int64_t>();
  if (trainer.communicator().rank() == 0) {
    feedback.set_residual(read_exchanged(ckpt, "feedback.safetensors", client_id, specs));
    drift.restore(read_exchanged(ckpt, "drift_anchor.safetensors", client_id, specs),
                  state.value("drift_anchor_round", int64_t{0}));
    *pulled = read_exchanged(ckpt, "pulled_model.safetensors", client_id, specs);
    load_local_dp(local_dp, state.contains("local_dp") ? &state.at("local_dp") : nullptr, round,
                  ckpt, client_id);
    if (unsettled) *unsettled = load_unsettled(state, ckpt, client_id, specs);
  }
  return round;
}

// The newest state under dir that verifies and was saved after a round before `round` (none:
// there is none). When there is one, the newer states (of `round` and later: the lost attempt's
// training) are removed, so that neither retention nor a restart takes them for the newest.
std::optional<fs::path> state_before(const fs::path& dir, int64_t round) {
  const auto states = io::list_checkpoints(dir / "checkpoints");
  std::vector<fs::path> lost;
  for (auto it = states.rbegin(); it != states.rend(); ++it) {
    if (auto why = io::verify_checkpoint(*it)) {
      log::warn("skipping client state ", it->string(), ": ", *why);
      continue;
    }
    const auto state = nlohmann::json::parse(read_file(*it / "state.json"), nullptr, false);
    if (state.is_discarded() || !state.contains("round") || !state["round"].is_number_integer())
      continue;
    if (state["round"].get<int64_t>() >= round) {
      lost.push_back(*it);
      continue;
    }
    for (const fs::path& p : lost) fs::remove_all(p);
    return *it;
  }
  return std::nullopt;
}

}  // namespace

int64_t load_client_state(const fs::path& dir, const std::string& client_id, LocalTrainer& trainer,
                          const ParamSpecs& specs, ErrorFeedback& feedback, DriftCorrection& drift,
                          Weights* pulled, LocalDp* local_dp,
                          std::optional<UnsettledPush>* unsettled) {
  // Rank 0 chooses the state (the newest that verifies) and tells the silo's other ranks, which
  // load the same one.
  dist::Communicator& comm = trainer.communicator();
  int64_t choice[2] = {-1, 0};  // {step or -1 for none, states skipped}
  if (comm.rank() == 0) {
    const auto point =
        io::choose_checkpoint_to_resume(dir / "checkpoints", cat("fed client '", client_id, "'"));
    if (point.dir) choice[0] = io::checkpoint_step(*point.dir);
    choice[1] = point.skipped;
  }
  // No watchdog: rank 0 verifies the state's hashes first, which can outlast parallel.timeout_s.
  comm.wait_for_broadcast(std::span<int64_t>(choice, 2), 0, "the choice of client state to resume");
  refuse_if_none_verifies(choice[0] >= 0, choice[1], dir, client_id);
  const int64_t chosen = choice[0];
  if (chosen < 0) return 0;
  const fs::path ckpt = dir / "checkpoints" / io::checkpoint_name(chosen);
  const int64_t round =
      restore_state(ckpt, client_id, trainer, specs, feedback, drift, pulled, local_dp, unsettled);
  log::info("fed client '", client_id, "': resumed its state of round ", round, " (",
            trainer.steps_taken(), " local steps) from ", ckpt.string());
  return round;
}

int64_t rewind_client_state(const fs::path& dir, const std::string& client_id, int64_t round,
                            LocalTrainer& trainer, const ParamSpecs& specs, ErrorFeedback& feedback,
                            DriftCorrection& drift, Weights* pulled, std::string_view why) {
  const auto ckpt = state_before(dir, round);
  if (!ckpt) return -1;
  const int64_t was =
      restore_state(*ckpt, client_id, trainer, specs, feedback, drift, pulled, nullptr, nullptr);
  log::info("fed client '", client_id, "': round ", round, " again (", why,
            "): back to its state of round ", was, " (", trainer.steps_taken(),
            " local steps) from ", ckpt->string());
  return was;
}

int64_t load_revealed_round(const fs::path& dir, const std::string& client_id) {
  const fs::path file = dir / "secagg_revealed_round";
  if (!fs::exists(file)) return 0;
  const std::string text = read_file(file);
  int64_t round = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), round);
  POLLEN_CHECK(ec == std::errc() && end == text.data() + text.size() && round >= 1, "fed client '",
               client_id, "': ", file.string(), " holds '", text.substr(0, 32),
               "', expected the last round whose secure aggregation shares it revealed (an "
               "integer of at least 1)");
  return round;
}

void save_revealed_round(const fs::path& dir, int64_t round) {
  fs::create_directories(dir);
  write_file_atomic(dir / "secagg_revealed_round", std::to_string(round));
}

void save_client_state(const fs::path& dir, int keep, const std::string& client_id, int64_t round,
                       const LoraSilo& silo, const ParamSpecs& specs, const ErrorFeedback& feedback,
                       const Weights& pulled, const LocalDp* local_dp,
                       const std::optional<UnsettledPush>& unsettled) {
  io::CheckpointWriter w(dir / "checkpoints", silo.steps_taken());
  const nlohmann::ordered_json trained = silo.write_state(w);
  const io::NamedTensors residual = named(feedback.residual(), specs);
  if (!residual.empty()) w.add_tensors("feedback.safetensors", residual);
  if (!pulled.empty()) w.add_tensors("pulled_model.safetensors", named(pulled, specs));
  nlohmann::ordered_json state{{"client", client_id},
                               {"round", round},
                               {"data_manifest_hash", silo.manifest_hash()},
                               {"base_sha256", silo.base_sha256()},
                               {"lora_config", lora_config_json(silo.lora_config())},
                               {"silo", trained}};
  save_local_dp(local_dp, state);
  save_unsettled(unsettled, specs, w, state);
  w.add_text("state.json", state.dump(1));
  w.commit();
  io::apply_retention(dir / "checkpoints", keep);
}

namespace {

int64_t restore_state(const fs::path& ckpt, const std::string& client_id, LoraSilo& silo,
                      const ParamSpecs& specs, ErrorFeedback& feedback, Weights* pulled,
                      LocalDp* local_dp, std::optional<UnsettledPush>* unsettled) {
  const auto state = nlohmann::ordered_json::parse(read_file(ckpt / "state.json"));
  check_owner(state, ckpt, client_id, silo.manifest_hash());
  POLLEN_CHECK(
      state.at("base_sha256").get<std::string>() == silo.base_sha256() &&
          state.at("lora_config").get<std::string>() == lora_config_json(silo.lora_config()),
      "fed client '", client_id, "': state ", ckpt.string(),
      " holds adapters of another base or LoRA config than post.run's; remove the state "
      "folder to start this silo afresh");
  silo.read_state(ckpt, state.at("silo"));
  feedback.set_residual(read_exchanged(ckpt, "feedback.safetensors", client_id, specs));
  *pulled = read_exchanged(ckpt, "pulled_model.safetensors", client_id, specs);
  const int64_t round = state.at("round").get<int64_t>();
  const nlohmann::json saved_dp = state.value("local_dp", nlohmann::ordered_json());
  load_local_dp(local_dp, saved_dp.is_null() ? nullptr : &saved_dp, round, ckpt, client_id);
  if (unsettled) *unsettled = load_unsettled(state, ckpt, client_id, specs);
  return round;
}

}  // namespace

int64_t load_client_state(const fs::path& dir, const std::string& client_id, LoraSilo& silo,
                          const ParamSpecs& specs, ErrorFeedback& feedback, Weights* pulled,
                          LocalDp* local_dp, std::optional<UnsettledPush>* unsettled) {
  const auto choice =
      io::choose_checkpoint_to_resume(dir / "checkpoints", cat("fed client '", client_id, "'"));
  refuse_if_none_verifies(choice.dir.has_value(), choice.skipped, dir, client_id);
  if (!choice.dir) return 0;
  const int64_t round =
      restore_state(*choice.dir, client_id, silo, specs, feedback, pulled, local_dp, unsettled);
  log::info("fed client '", client_id, "': resumed its state of round ", round, " (",
            silo.steps_taken(), " local steps) from ", choice.dir->string());
  return round;
}

int64_t rewind_client_state(const fs::path& dir, const std::string& client_id, int64_t round,
                            LoraSilo& silo, const ParamSpecs& specs, ErrorFeedback& feedback,
                            Weights* pulled, std::string_view why) {
  const auto ckpt = state_before(dir, round);
  if (!ckpt) return -1;
  const int64_t was =
      restore_state(*ckpt, client_id, silo, specs, feedback, pulled, nullptr, nullptr);
  log::info("fed client '", client_id, "': round ", round, " again (", why,
            "): back to its state of round ", was, " (", silo.steps_taken(), " local steps) from ",
            ckpt->string());
  return was;
}

}  // namespace pollen::fed
