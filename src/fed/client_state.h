#pragma once
// A client's local state on disk, so that a restarted silo continues where it stopped: the
// inner AdamW moments and step count, the training loader's position (its seed, epoch and
// cursor: the only randomness of local training), the error-feedback residual, the drift
// correction's anchor (fed/drift_correction.h), the last round's model as pulled (so that a
// compressed download goes on as a delta, fed/model_view.h), [local_dp]'s privacy accountant (so
// that the epsilon it reports counts every round released), the last round it trained and, when
// saved before a push, that push's round and the residual from before it (UnsettledPush). Written
// after every round as a checkpoint (atomic, checksummed) under `dir`/checkpoints/step-<local
// step>; the newest that verifies is resumed. A silo of several ranks writes it once, from rank 0,
// in the same format (so it resumes at any number of ranks); every rank loads it (the
// error-feedback residual, the anchor and the pulled model are rank 0's alone). A post-training
// silo (LoraSilo) writes its adapters' B instead of the model (adapter.safetensors), the moments of
// B, and its objective's state (data position), beside the same state.json, residual and pulled
// model; its state also names the base's fingerprint, and a state of another base is refused.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "fed/compress.h"
#include "fed/drift_correction.h"
#include "fed/wire.h"

namespace pollen::fed {

class LocalTrainer;
class LoraSilo;
class LocalDp;

// A push sent without the server's answer (yet): whether the update arrived is known from the
// next task's update_round. Its round, and the error-feedback residual from before it, which
// comes back if the update did not arrive. Kept in the state saved before the push, so that a
// client killed before it knows settles it after its restart.
struct UnsettledPush {
  int64_t round = 0;
  Weights residual;
};

// `pulled`: the last round's model as the client rebuilt it (empty: none); `local_dp`: the
// client's [local_dp] (null without); `unsettled`: the push this state is saved before (none
// when there is none).
void save_client_state(const std::filesystem::path& dir, int keep, const std::string& client_id,
                       int64_t round, LocalTrainer& trainer, const ParamSpecs& specs,
                       const ErrorFeedback& feedback, const DriftCorrection& drift,
                       const Weights& pulled, const LocalDp* local_dp,
                       const std::optional<UnsettledPush>& unsettled);

// Restores the newest valid state under dir (a collective of the trainer's ranks); returns the
// last round trained then, or 0 when there is none. Throws when the state belongs to another
// client or another dataset, when none verifies, or when `local_dp` is given and the state's
// rounds were released without it. *pulled gets the saved pulled model (empty when the state has
// none), *unsettled the push it was saved before (none when there is none). The residual, anchor,
// pulled model, accountant and unsettled push are rank 0's alone.
int64_t load_client_state(const std::filesystem::path& dir, const std::string& client_id,
                          LocalTrainer& trainer, const ParamSpecs& specs, ErrorFeedback& feedback,
                          DriftCorrection& drift, Weights* pulled, LocalDp* local_dp,
                          std::optional<UnsettledPush>* unsettled);

// For a client asked to train a round it trained already (its update was lost: the server
// resumed from an earlier checkpoint, or the round was retried), or again after an attempt that
// failed before its state was saved (`why` says which, for the log): restores the newest state that
// verifies of a round before `round`, so that the round is trained again from where the
// federation stands, on the same data (one process only; the privacy accountant is left as it
// is: the lost update was released, and so is the push the client waits to settle). Returns
// that state's round, or -1 when there is none (nothing is changed).
int64_t rewind_client_state(const std::filesystem::path& dir, const std::string& client_id,
                            int64_t round, LocalTrainer& trainer, const ParamSpecs& specs,
                            ErrorFeedback& feedback, DriftCorrection& drift, Weights* pulled,
                            std::string_view why);

// Secure aggregation: the last round whose shares the client revealed, kept in
// `dir`/secagg_revealed_round beside the states (rewinding leaves it as it is); 0 when there is
// none. The client never trains that round, or an earlier one, again from before it.
int64_t load_revealed_round(const std::filesystem::path& dir, const std::string& client_id);
void save_revealed_round(const std::filesystem::path& dir, int64_t round);

}  // namespace pollen::fed

namespace pollen::fed {

// The same for a post-training silo (one process).
void save_client_state(const std::filesystem::path& dir, int keep, const std::string& client_id,
                       int64_t round, const LoraSilo& silo, const ParamSpecs& specs,
                       const ErrorFeedback& feedback, const Weights& pulled,
                       const LocalDp* local_dp, const std::optional<UnsettledPush>& unsettled);
int64_t load_client_state(const std::filesystem::path& dir, const std::string& client_id,
                          LoraSilo& silo, const ParamSpecs& specs, ErrorFeedback& feedback,
                          Weights* pulled, LocalDp* local_dp,
                          std::optional<UnsettledPush>* unsettled);
int64_t rewind_client_state(const std::filesystem::path& dir, const std::string& client_id,
                            int64_t round, LoraSilo& silo, const ParamSpecs& specs,
                            ErrorFeedback& feedback, Weights* pulled, std::string_view why);

}  // namespace pollen::fed
