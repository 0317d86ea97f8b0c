// A client's life: built (resuming its saved state), it joins and asks for tasks until the run
// is over; a task of a round it trained already takes it back to its state before that round.
// The rest of Client: client_round.cpp (a training round: pull, train, push), client_secagg.cpp
// (secure aggregation), client_state.cpp (its state on disk). LocalTrainer, the silo's inner
// loop: client_local_trainer.cpp and client_local_trainer_moments.cpp. The in-process
// transport: client_transport.cpp.
#include "fed/client.h"

#include <chrono>
#include <thread>

#include "base/files.h"
#include "base/log.h"
#include "fed/client_state.h"
#include "fed/silo.h"

namespace pollen::fed {

void BusyServerWait::busy(const ServerBusy& e, const char* then) {
  const auto now = std::chrono::steady_clock::now();
  if (!busy_since_)
    busy_since_ = now - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(call_timeout_s_));
  const double waited = std::chrono::duration<double>(now - *busy_since_).count();
  POLLEN_CHECK(waited < limit_s_, "fed client '", client_id_, "': ", e.what(),
               "; the server has not answered for ", waited,
               " s in a row, past client.busy_timeout_s = ", limit_s_, " s");
  log::warn("fed client '", client_id_, "': ", e.what(), "; ", then);
  // A server out of room answers at once: ask again in a second, not in a busy loop.
  std::this_thread::sleep_for(std::chrono::seconds(1));
}

Client::Client(ClientConfig config, Transport& transport, dist::Communicator* comm)
    : config_(std::move(config)),
      transport_(transport),
      comm_(comm),
      drift_(config_.train.drift_correction) {
  if (config_.post.enabled()) {
    silo_ = make_lora_silo(config_, comm);
    // What Join proposes: the base's architecture and tokenizer, as the run file resolved them.
    config_.model = silo_->model().config();
    config_.tokenizer_fingerprint = silo_->tokenizer_fingerprint();
    trainer_ = silo_.get();
  } else {
    local_ = std::make_unique<LocalTrainer>(config_, comm);
    trainer_ = local_.get();
  }
  specs_ = trainer_->exchanged_specs();
  if (config_.local_dp.enabled) local_dp_ = std::make_unique<LocalDp>(config_.local_dp);
  Weights pulled;  // the last round's model, from the state
  if (!config_.state_dir.empty()) {
    last_round_ = silo_
                      ? load_client_state(config_.state_dir, config_.id, *silo_, specs_, feedback_,
                                          &pulled, local_dp_.get(), &unsettled_push_)
                      : load_client_state(config_.state_dir, config_.id, *local_, specs_, feedback_,
                                          drift_, &pulled, local_dp_.get(), &unsettled_push_);
    revealed_round_ = load_revealed_round(config_.state_dir, config_.id);
  }
  if (local_dp_) take_local_dp_record();
  // [dp_sgd]'s account is never rolled back, so it holds at least every local step the state
  // took; fewer means steps that ran without it, or a lost account: no epsilon covers them.
  if (const optim::DpSgd* dp = local_ ? local_->dp_sgd() : nullptr) {
    POLLEN_CHECK(dp->steps_accounted() >= local_->steps_taken(), "client '", config_.id,
                 "': its state holds ", local_->steps_taken(), " local steps but [dp_sgd]'s ",
                 "account in '", config_.state_dir.string(), "' only ", dp->steps_accounted(),
                 ": steps ran without [dp_sgd], or its account was lost, and no epsilon covers "
                 "them");
  }
  // Every saved state holds the model pulled last, so none was found when `pulled` is empty.
  const bool fresh = pulled.empty();
  // A client holding the server's last model, or one that built the server's initial model (the
  // same seed or model.init_from), takes the round's compressed model as a delta; otherwise the
  // server names another model and sends it whole.
  held_ = std::make_unique<HeldModel>(pulled.empty() ? trainer_->exchanged_weights()
                                                     : std::move(pulled));
  // The state before round 1, for a first round trained again (its update lost) to start from.
  initial_state_unsaved_ = fresh && !several_ranks();
}

LocalTrainer& Client::trainer() {
  POLLEN_CHECK(local_ != nullptr, "client '", config_.id,
               "': a post-training silo has no pre-training trainer");
  return *local_;
}

void Client::save_state() {
  if (config_.state_dir.empty()) return;
  if (silo_) {
    save_client_state(config_.state_dir, config_.keep_checkpoints, config_.id, last_round_, *silo_,
                      specs_, feedback_, held_->model(), local_dp_.get(), unsettled_push_);
  } else {
    save_client_state(config_.state_dir, config_.keep_checkpoints, config_.id, last_round_, *local_,
                      specs_, feedback_, drift_, held_->model(), local_dp_.get(), unsettled_push_);
  }
}

void Client::join() {
  pb::JoinRequest r;
  r.set_protocol_version(kProtocolVersion);
  r.set_client_id(config_.id);
  r.set_model_config(model_config_json(config_.model));
  r.set_tokenizer_fingerprint(config_.tokenizer_fingerprint);
  r.set_data_manifest_hash(trainer_->manifest_hash());
  if (silo_) {
    r.set_base_fingerprint(silo_->base_sha256());
    r.set_lora_config(lora_config_json(silo_->lora_config()));
    r.set_post_objective(config_.post.objective);
  }
  pb::JoinReply reply;
  BusyServerWait wait(config_.id, config_.busy_timeout_s, config_.connect_timeout_s);
  for (;;) {
    try {
      reply = transport_.join(r);
      break;
    } catch (const ServerBusy& e) {
      wait.busy(e, "joining again");
    }
  }
  POLLEN_CHECK(reply.accepted(), "the server refused client '", config_.id, "': ", reply.reason());
  keep_run_id(reply.run_id());
  if (initial_state_unsaved_) save_state();
  initial_state_unsaved_ = false;
}

void Client::keep_run_id(const std::string& run_id) {
  // The state folder belongs to one federation run: a state of another (a finished run's, a
  // client.toml reused for a new federation) would carry its optimizer, data position and
  // error feedback into this one.
  if (config_.state_dir.empty() || run_id.empty()) return;
  const std::filesystem::path file = config_.state_dir / "server_run_id";
  if (std::filesystem::exists(file)) {
    const std::string held = read_file(file);
    POLLEN_CHECK(held == run_id, "fed client '", config_.id, "': client.state_dir '",
                 config_.state_dir.string(), "' holds the state of another federation run (", held,
                 "; this server's is ", run_id,
                 "): remove it, or give this federation another client.state_dir");
    return;
  }
  std::filesystem::create_directories(config_.state_dir);
  write_file_atomic(file, run_id);
}

pb::TaskKind Client::poll_once() {
  pb::TaskRequest r;
  r.set_client_id(config_.id);
  const auto t = transport_.task(r);
  settle_push(t);
  handle(t);
  return t.kind();
}

void Client::settle_push(const pb::TaskReply& task) {
  if (!unsettled_push_) return;
  const int64_t round = unsettled_push_->round;
  if (task.update_round() >= round) {
    // One of this process's pushes, or the state's: pushed before a restart, its answer was not
    // saved (the state is written before a push, not again after it).
    log::info("fed client '", config_.id, "': round ", round, "'s update reached the server",
              pushes_ > 0 ? ", though its answer was lost" : " (pushed before this restart)");
    unsettled_push_.reset();
    return;
  }
  // Not held: known once the server gives this client work again (the same round again, which
  // also goes back to the state before it, or a later one) or ends the run.
  if (task.kind() == pb::TASK_WAIT) return;
  log::warn("fed client '", config_.id, "': round ", round,
            "'s update did not reach the server: the error feedback held back for it is void");
  feedback_.set_residual(unsettled_push_->residual);
  unsettled_push_.reset();
  save_state();
}

void Client::handle(const pb::TaskReply& t) {
  switch (t.kind()) {
    case pb::TASK_TRAIN:
      return train_round(t);
    case pb::TASK_SECAGG_ADVERTISE:
    case pb::TASK_SECAGG_SHARE:
    case pb::TASK_SECAGG_UNMASK:
      return secagg_step(t);
    default:
      return;
  }
}

void Client::note_push(int64_t round) {
  if (first_pushed_round_ == 0) first_pushed_round_ = round;
  ++pushes_;
}

void Client::check_some_update_counted(const pb::TaskReply& done) const {
  // update_round is the last round aggregated with this silo's update, by this process or an
  // earlier one of the silo (a restarted client): 0 is none ever.
  POLLEN_CHECK(
      first_pushed_round_ == 0 || done.update_round() > 0, "fed client '", config_.id,
      "': the run is over, and the server aggregated none of this silo's updates (this ",
      "process pushed ", pushes_, ", from round ", first_pushed_round_,
      "): each came after its round had closed or was refused (see the warnings "
      "above; a round closes at the server's server.round_timeout_s); the global model holds "
      "nothing of this silo's data");
}

void Client::run() {
  BusyServerWait wait(config_.id, config_.busy_timeout_s, config_.connect_timeout_s);
  for (;;) {
    pb::TaskRequest r;
    r.set_client_id(config_.id);
    pb::TaskReply t;
    try {
      t = transport_.task(r);
      wait.answered();
      settle_push(t);
    } catch (const ServerBusy& e) {
      wait.busy(e, "asking again");
      continue;
    } catch (const Error& e) {
      // A restarted server has forgotten who joined (and a server that stays away past
      // connect_timeout_s makes join throw): join again, then ask again.
      log::warn("fed client '", config_.id, "': task failed (", e.what(), "); joining again");
      join();
      wait.answered();
      continue;
    }
    switch (t.kind()) {
      case pb::TASK_DONE:
        if (several_ranks()) send_order(*comm_, {}, nullptr);
        // A run the server gave up is a failure for its clients too (a non-zero exit).
        POLLEN_CHECK(
            t.stopped().empty(), "fed client '", config_.id,
            "': the server stopped the run before its last round: ", t.stopped().substr(0, 1024));
        check_some_update_counted(t);
        log::info("fed client '", config_.id, "': the run is over");
        return;
      case pb::TASK_TRAIN:
      case pb::TASK_SECAGG_ADVERTISE:
      case pb::TASK_SECAGG_SHARE:
      case pb::TASK_SECAGG_UNMASK:
        try {
          handle(t);
        } catch (const dist::PeerFailure&) {
          throw;  // a rank of this silo died or hangs: the silo's job ends
        } catch (const RoundCannotSucceed&) {
          throw;
        } catch (const Error& e) {
          // A round that closed or a stream that broke: the next task says what to do, after a
          // pause, so that a failure that repeats does not spin.
          log::warn("fed client '", config_.id, "': round ", t.round(), " failed: ", e.what());
          std::this_thread::sleep_for(std::chrono::seconds(1));
        }
        break;
      default:
        std::this_thread::sleep_for(
            std::chrono::milliseconds(std::clamp<int64_t>(t.wait_ms(), 10, 5000)));
    }
  }
}

namespace {
constexpr const char* kLocalDpRecord = "local_dp.json";
}  // namespace

void Client::record_local_dp() const {
  write_file_atomic(config_.state_dir / kLocalDpRecord, local_dp_->state().dump() + "\n");
}

void Client::take_local_dp_record() {
  POLLEN_CHECK(!config_.state_dir.empty(), "client '", config_.id,
               "': [local_dp] keeps its account in client.state_dir, so that a restarted client "
               "counts every update it released; set client.state_dir (in a simulation, leave "
               "sim.client_states on)");
  const std::filesystem::path record = config_.state_dir / kLocalDpRecord;
  if (!std::filesystem::exists(record)) return;
  try {
    const nlohmann::json saved = nlohmann::json::parse(read_file(record));
    if (saved.at("steps").get<int64_t>() <= local_dp_->releases()) return;
    local_dp_->load_state(saved);
  } catch (const nlohmann::json::exception& e) {
    fail("client '", config_.id, "': '", record.string(),
         "': expected [local_dp]'s account: ", e.what());
  }
  log::info("client '", config_.id, "': [local_dp] goes on from the account in '", record.string(),
            "': ", local_dp_->releases(), " updates released so far, epsilon ",
            local_dp_->epsilon().epsilon);
}

void Client::rewind(int64_t round) {
  if (round <= revealed_round_) {
    // The server may hold the unmasked sum of an attempt this client revealed its shares for;
    // the same input again, in a sum over other clients, would give away the difference of the
    // two sums: whole clients' updates. Going on from here makes the new input differ.
    unsaved_steps_ = false;
    log::warn("fed client '", config_.id, "': round ", round,
              " again, after it revealed its secure aggregation shares of round ", revealed_round_,
              ": it trains on from where it is (its local steps and data position kept), never "
              "going back, so that it never sends an input the server may have unmasked");
    return;
  }
  const char* why = round <= last_round_ ? "its update was lost"
                                         : "an attempt at it failed before its state was saved";
  int64_t was = -1;
  Weights pulled;
  if (!config_.state_dir.empty() && !several_ranks()) {
    was = silo_ ? rewind_client_state(config_.state_dir, config_.id, round, *silo_, specs_,
                                      feedback_, &pulled, why)
                : rewind_client_state(config_.state_dir, config_.id, round, *local_, specs_,
                                      feedback_, drift_, &pulled, why);
  }
  unsaved_steps_ = false;  // restored, or kept with the warning below
  if (was < 0) {
    log::warn("fed client '", config_.id, "': round ", round, " again (", why,
              "); the local steps it took for it stay in its optimizer and data position",
              config_.state_dir.empty() ? " (client.state_dir keeps states to go back to)"
              : several_ranks()         ? " (a silo of several ranks does not go back)"
                                        : " (no saved state of an earlier round)");
    return;
  }
  last_round_ = was;
  if (!pulled.empty()) held_ = std::make_unique<HeldModel>(std::move(pulled));
}

}  // namespace pollen::fed
