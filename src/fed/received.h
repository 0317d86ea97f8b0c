#pragma once
// What each side checks in the messages it receives, before any of their content is used: a
// server in a join and in a pushed update, a client in the task of a round. The coordinator and
// the client call these, and the federation wire's fuzz target calls the same functions, so that
// what is fuzzed is what runs.
#include <cstdint>
#include <string>

#include "fed/compress.h"
#include "fed/wire.h"

namespace pollen::fed {

// What the server publishes and every joining client must agree with.
struct ServerTerms {
  std::string model_json;             // model_config_json of the global model
  std::string tokenizer_fingerprint;  // the shared tokenizer's
  std::string lora_json;              // post-training: the adapters' config; empty otherwise
  std::string base_sha256;            // post-training: the frozen base model's fingerprint
  std::string post_objective;         // post-training: the objective the silos train
};

// A join: the client id, field sizes, then agreement with `terms` (protocol, model, tokenizer,
// post-training base and adapters). Throws naming the client and everything that differs.
void check_join_request(const pb::JoinRequest& r, const ServerTerms& terms);

// What a pushed update must hold, as the server's config sets it.
struct UpdateRules {
  ParamSpecs model;             // the pseudo-gradient's tensors
  ParamSpecs first_moments;     // sent after them (strategy.first_moments); empty: none
  CompressOptions codec;        // the upload codec (compression)
  bool token_counts = false;    // rows weighted by token counts: the update carries them
  bool second_moments = false;  // shared second moments: the update carries them, packed
  int ring_bits = 0;            // secure aggregation's ring; 0: the update is not masked
  ParamSpecs masked;            // secure aggregation: the masked set's (secagg::masked_specs)
  int64_t vocab_size = 0;
  // GRPO: its policy loss and held-out loss (the negated mean reward) may be negative; every
  // other objective's losses are cross-entropies, never negative.
  bool negative_losses = false;
};

// The update info (id, round, tokens, losses, token counts, second moments), then the header of
// its tensor set (names, shapes, codec; a masked set under secure aggregation).
void check_update_info(const pb::UpdateInfo& info, const UpdateRules& rules,
                       const std::string& what);
void check_update_header(const pb::TensorSetHeader& header, const UpdateRules& rules,
                         const std::string& what);

// An unmasked update's assembled bytes decoded and checked: the pseudo-gradient (every value
// within kMaxUpdateValue), then the first moments.
struct UpdateTensors {
  Weights delta;          // (rules.model)
  Weights first_moments;  // (rules.first_moments)
};
UpdateTensors decode_update(const pb::TensorSetHeader& header, const std::string& bytes,
                            const UpdateRules& rules, const std::string& what);

// A round's task as a client reads it: round and local steps in range, the codecs of the upload
// and of the model download, the SHA-256 of the round's model when named. Throws naming the
// field.
struct TaskCodecs {
  CompressOptions update;  // what the client sends
  CompressOptions model;   // what the client pulls
};
TaskCodecs check_task(const pb::TaskReply& task);

}  // namespace pollen::fed
