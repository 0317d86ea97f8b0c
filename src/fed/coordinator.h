#pragma once
// The server's side of federated training, without the transport: clients join (agreement
// check), ask for tasks, pull the round's global model and push updates; rounds are opened and
// closed by begin_round / end_round (the simulation calls them directly, `pollen fed server`
// through run(), which waits for clients and deadlines). Every method is thread-safe.
//
// After each aggregated round the server checkpoints its whole state (global weights, the
// strategy's state, the round, the lineage of every round, the metrics files' positions) and
// resumes from the newest checkpoint that verifies.
//
// With [post] (a post-training federation) the global "model" is the LoRA adapters' B of the
// run file's [lora] on its base (fed/post_lora.h): the base is loaded once, only to fingerprint
// it; Join must agree on its fingerprint and the LoRA config besides the architecture and the
// tokenizer; every checkpoint also writes the global adapters as a PEFT folder, server.dir/adapter.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "fed/config.h"
#include "fed/model_view.h"
#include "fed/post_lora.h"
#include "fed/received.h"
#include "fed/secagg/session.h"
#include "fed/wire.h"
#include "model/lora.h"
#include "obs/metrics.h"
#include "obs/progress.h"

namespace pollen::fed {

struct RoundSummary {
  int64_t round = 0;
  bool aggregated = false;
  std::vector<std::string> selected, participants, dropped;
  // train_loss: NaN when no update came (a Poisson-sampled DP round that still released);
  // eval_loss: NaN when no client evaluated
  double train_loss = 0, eval_loss = 0;
  int64_t tokens = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;  // the round's model out, updates in
  double wall_s = 0;
  std::map<std::string, double> client_train_loss, client_eval_loss;
  // A post-training objective's own scalars (GRPO's "reward", ...), token-weighted over the
  // participants; empty in pre-training
  std::map<std::string, double> metrics;
};

// The server's status (what /metrics shows): the last closed round and totals since start.
struct ServerStatus {
  int64_t rounds_done = 0, rounds_total = 0;
  int64_t open_round = 0;     // 0 when no round is open
  int64_t round_retries = 0;  // failed attempts at the next round, kept across a restart
  size_t clients_joined = 0, clients_alive = 0;
  RoundSummary last;  // round 0 before any round closed
  uint64_t bytes_sent_total = 0, bytes_received_total = 0;
  int64_t dropped_total = 0, retries_total = 0, tokens_total = 0;
  // Under [privacy]: epsilon spent so far at delta, and the releases accounted.
  bool private_ = false;
  double epsilon = 0, delta = 0;
  int64_t private_rounds = 0;
};

class Coordinator {
 public:
  // Starts from the newest valid checkpoint under dir/checkpoints when `resume`, else from a
  // freshly initialised model (refusing to overwrite a run that has checkpoints).
  Coordinator(ServerConfig config, bool resume);
  ~Coordinator();

  // `peer_id`: the authenticated identity (certificate common name), empty without TLS.
  pb::JoinReply join(const pb::JoinRequest& request, const std::string& peer_id);
  pb::TaskReply task(const pb::TaskRequest& request, const std::string& peer_id);
  // The round's encoded global model; throws when the client is not part of that round.
  std::shared_ptr<const EncodedSet> pull(const pb::PullRequest& request,
                                         const std::string& peer_id);

  // A push: begin with the update info and header (validated), add chunks, finish.
  struct Push {
    pb::UpdateInfo info;
    pb::TensorSetHeader header;
    std::unique_ptr<ChunkAssembler> chunks;
    int64_t attempt = 0;             // the round attempt it began in: only that attempt takes it
    std::shared_ptr<void> arriving;  // while held, the client's one push that may arrive
  };
  Push push_begin(const pb::UpdateInfo& info, const pb::TensorSetHeader& header,
                  const std::string& peer_id);
  pb::PushReply push_finish(Push& push);
  // Refuses a chunk of a push whose round attempt closed meanwhile, so that a client trickling
  // chunks holds no stream past its round.
  void check_push_open(const Push& push) const;

  // Secure aggregation's key, share and unmask steps (fed/secagg/session.h); refused when the
  // server does not aggregate securely.
  pb::SecAggReply secagg(const pb::SecAggRequest& request, const std::string& peer_id);
  // Closes the open round's secure-aggregation phase with the clients that answered, as its
  // deadline does; false when there is none to close.
  bool close_phase();
  // The open round's secure-aggregation state (null without): what the server holds.
  const secagg::ServerSession* secagg_session() const { return secagg_.get(); }

  // Opens the next round with the clients alive now; false when every round is done or fewer
  // than min_clients are alive.
  bool begin_round();
  // Whether every selected client has pushed.
  bool round_complete() const;
  // Closes the round: aggregates when at least min_clients updates came (always under central
  // DP's Poisson sampling, whose release is accounted whatever came), else the round is retried;
  // checkpoints and writes metrics either way.
  RoundSummary end_round();

  // `pollen fed server`: rounds until done (or stop()), waiting for clients and deadlines.
  void run();
  void stop();

  int64_t rounds_done() const;
  bool finished() const;
  // Once finished: how many clients heard from within client_timeout_s have not yet been told
  // that the run is over (by a task request's answer).
  size_t clients_not_told_done() const;
  // [post] with objective "rm", after the last round: the global adapters merged into the base
  // and the global score head, exported as `pollen rm` exports a reward model, to
  // server.dir/reward_model; returns that folder.
  std::filesystem::path export_reward_model();
  // Why the run ended before its last round (min_clients, retries, the privacy budget); empty
  // when it did not.
  std::string stopped_reason() const;
  Weights global_weights() const;
  const ParamSpecs& specs() const { return specs_; }
  const ServerConfig& config() const { return config_; }
  size_t alive_clients() const;
  ServerStatus status() const;
  // A call of client `id` was refused for its revoked certificate: it can take part in nothing
  // until it joins with another, so the open round no longer waits for its update (without
  // secure aggregation, whose phases have their own deadlines) and no later round selects it.
  void client_revoked(const std::string& id);

 private:
  struct ClientState {
    std::string manifest_hash;
    std::chrono::steady_clock::time_point last_seen;
    int64_t last_aggregated_round = 0;  // the last round aggregated with its update (0: none)
    bool told_done = false;             // answered TASK_DONE
  };
  struct Update {
    ClientUpdate update;
    Weights first_moments;  // strategy.first_moments: the client's, as decoded
    pb::UpdateInfo info;
    uint64_t bytes = 0;
  };
  std::string check_peer(const std::string& claimed, const std::string& peer_id,
                         const char* what) const;
  void save_checkpoint(const RoundSummary& s);
  void load_checkpoint(const std::filesystem::path& dir);
  // [post]: the global adapters into dir/adapter, as `pollen chat --adapter` and PEFT take them.
  void save_global_adapter();
  // On resume: warns of each config key that differs from the checkpoint's `state` (its
  // "settings") and changes the training, old and new value; keys of deadlines, addresses, TLS
  // files, retention and the number of rounds may change freely.
  void warn_of_changed_settings(const nlohmann::json& state, const std::filesystem::path& ckpt);
  std::vector<std::string> alive_ids_locked() const;  // clients heard from within client_timeout_s
  int64_t last_aggregated_round_locked(const std::string& id) const;  // from the lineage
  void touch_locked(const std::string& id);                           // heard from now
  // The round's clients from `alive`: the strategy's fixed-size draw (from `rng`, or under
  // central DP from its secret generator), or a Poisson sample under privacy.sampling =
  // "poisson".
  std::vector<std::string> select_clients(int64_t round, const std::vector<std::string>& alive,
                                          Rng& rng) const;
  bool poisson_dp() const { return dp_ && config_.privacy.poisson(); }
  // Distributed DP with adaptive clipping: each masked update ends with the client's count.
  bool counts_unclipped() const {
    return dp_ && config_.secure_aggregation.enabled && config_.privacy.adaptive_clip;
  }
  void advance_secagg_locked();
  // Closes the secure round's phase; when the input phase closes, the masked sum must fit the
  // ring before anyone is asked to reveal a share.
  void close_secagg_phase_locked();
  bool round_complete_locked() const;
  // Unmasks the sum and applies it; false (with the reason in *why) when the round fails. With
  // distributed DP the sum is divided by the `selected` clients.
  // With adaptive clipping *count is set to the count's unmasked mean.
  bool aggregate_secure(int64_t round, int64_t tokens, size_t participants, size_t selected,
                        std::optional<double>* count, std::string* why);
  // Under [privacy], before round `round`: empty when it may start, else why not (the budget,
  // adaptive clipping's count noise, or with secure aggregation a ring that cannot hold the
  // noise).
  std::string refuse_private_round_locked(int64_t round, int64_t selected, int64_t available) const;
  // Under distributed DP: what a round of `selected` clients releases, at each RDP order.
  std::vector<double> distributed_release_rdp_locked(size_t selected) const;
  // Under distributed DP: how far the rounding may grow an update's norm past the clip, D2 step /
  // C (fed/secagg/private_quantize.h); a round costs about its square times the Gaussian's RDP.
  double rounding_growth_locked() const;
  // The open round's secure aggregation options, with distributed DP's noise for `selected`
  // clients once the session knows its threshold.
  secagg::Options secagg_options_locked(size_t selected) const;
  // Distributed DP, before any share of the round is revealed: the release charged to a copy of
  // the accountant, written to privacy_charge.json (write-ahead: a crash after the reveals, before
  // the round's checkpoint, cannot lose it). The checkpoint that holds the charge removes it.
  void write_privacy_charge_locked();
  // At start: a charge that no checkpoint holds yet is taken (its attempt's sample is not drawn
  // again); one a checkpoint holds is removed.
  void take_privacy_charge();
  std::filesystem::path privacy_charge_path() const { return config_.dir / "privacy_charge.json"; }
  // Central DP's ledger, privacy.json: the accountant after each round, written before the
  // round's checkpoint and never rolled back, so that a resume from an older checkpoint (the
  // newest did not verify) keeps counting the releases made since.
  std::filesystem::path privacy_ledger_path() const { return config_.dir / "privacy.json"; }
  // At start: a ledger that counts more releases than the checkpoint resumed from is taken.
  void take_privacy_ledger();
  void record_status(const RoundSummary& s);
  // Redraws the terminal's progress bar: rounds done, the open round's clients that reported.
  void show_progress_locked();
  // `round_metrics`: the round's metrics line, whose counts and privacy figures go there too.
  void write_tensorboard(const RoundSummary& s, const nlohmann::ordered_json& round_metrics);

  ServerConfig config_;
  std::unique_ptr<Strategy> strategy_;
  std::unique_ptr<CentralDp> dp_;  // central DP when [privacy] is given
  ParamSpecs specs_;
  Weights global_;
  ServerTerms terms_;  // what a joining client must agree with
  // [post]: the global adapters and the objective's own parameters (their values are
  // global_'s), the base's name.
  std::unique_ptr<PostGlobal> post_global_;
  std::string post_base_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, ClientState> clients_;
  int64_t done_ = 0;      // rounds aggregated
  int64_t retries_ = 0;   // failed attempts at the current round
  int64_t attempts_ = 0;  // rounds opened by begin_round, retries included
  bool open_ = false;
  bool finished_ = false;
  bool warned_rounding_growth_ = false;  // distributed DP: a coarse step was reported once
  std::string stopped_;  // why the run ended before its last round (empty: it did not)
  std::atomic<bool> stop_{false};
  std::set<std::string> selected_;
  std::set<std::string> revoked_;  // refused for a revoked certificate since they last joined
  std::string run_id_;             // server.dir/run_id: this run's, sent to every client that joins
  std::set<std::string> pulled_;   // client id, newline, the set's base and model: counted once
  int64_t round_available_ = 0;    // clients alive when the round opened (DP's sampling rate)
  std::map<std::string, Update> updates_;
  // Clients whose push stream is open, with its attempt and serial: one each per attempt, so
  // that a client cannot hold many streams' buffers (a stream of a closed attempt does not stop
  // the client's push in the next).
  struct Arriving {
    int64_t attempt = 0;
    uint64_t serial = 0;
  };
  std::map<std::string, Arriving> pushing_;
  uint64_t pushes_begun_ = 0;
  std::unique_ptr<ModelPublisher> publisher_;  // what each round's pull sends
  // strategy.second_moments: the clients' factored second moments averaged over the last
  // aggregated round, packed as they are sent with the next rounds' model (empty before the
  // first)
  std::string second_moments_;
  UpdateRules update_rules_;  // what a pushed update must hold
  // strategy.first_moments: the tensors whose moments travel (fed/first_moments.h), the clients'
  // moments averaged over the last aggregated round and the set the clients pull them as (null
  // before the first)
  ParamSpecs moment_specs_;
  Weights first_moments_;
  std::shared_ptr<const EncodedSet> first_moments_set_;
  void set_first_moments(Weights mean);
  uint64_t bytes_sent_ = 0;
  std::chrono::steady_clock::time_point round_start_;
  std::unique_ptr<secagg::ServerSession> secagg_;
  uint64_t secagg_bytes_in_ = 0, secagg_bytes_out_ = 0;
  nlohmann::json lineage_ = nlohmann::json::array();
  obs::JsonlWriter metrics_, lineage_file_;
  obs::EventFileWriter tensorboard_;
  ServerStatus totals_;  // last round and totals; the rest of status() is filled when asked
  std::unique_ptr<obs::Progress> progress_;  // on a terminal only
};

}  // namespace pollen::fed
