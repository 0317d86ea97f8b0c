#pragma once
// The federation wire without the transport: tensor sets as a header plus bounded chunks with a
// SHA-256 over the whole stream, the checks every received message goes through, and the
// agreement check (protocol, model config, tokenizer). The gRPC service (fed/grpc.h) and the
// in-process transport of `pollen fed simulate` both go through these functions.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fed/compress.h"
#include "fed/strategy.h"
#include "model/config.h"
#include "pollen_fed.pb.h"

namespace pollen::model {
class Llama;
}

namespace pollen::fed {

namespace pb = ::pollen::fed::v1;

// 2: the round's model may be compressed; 3: post-training federations (Join carries the base's
// fingerprint and the LoRA config; the exchanged tensors are the adapters' B); 4: top-k, and a
// compressed model download as a delta against the model the client holds; 5: the task names the
// round's model, and a client that missed rounds pulls the chain of deltas it missed; 6: shared
// second moments (strategy.second_moments); 7: block scales may be bf16 (compression.scale), and
// the second moments travel as 8-bit log codes; 8: shared first moments of the token rows
// (strategy.first_moments); 9: Join names the post-training objective (a reward model's score
// head travels beside B); 10: distributed DP, the roster's dp_* parameters (a client that ignored
// them would send unclipped, unnoised updates that the server would account as private); 11:
// adaptive clipping under distributed DP, the roster's dp_count_stddev and the masked count; 12:
// distributed DP's noise is the discrete Gaussian added to the rounded update (a client that added
// continuous noise before rounding would release what the server's accounting does not cover);
// 13: a client without the keys of a secure round drops out of it (SecAggRequest.drop_out, which
// an older server could not read); 14: streams that stand still are cancelled, and every task
// names update_round (a client whose push lost its answer learns whether it arrived); 15: the
// model config agreed on at Join holds sliding_window and rope_scaling (silos of another window or
// scaling trained another model unnoticed)
constexpr uint32_t kProtocolVersion = 15;
// The most deltas a compressed download keeps for clients that missed rounds (fed/model_view.h),
// so that a client reaches the round's model within kMaxChainLinks + 1 pulls.
constexpr size_t kMaxChainLinks = 62;
constexpr uint64_t kMaxChunkBytes = 1u << 20;  // 1 MiB per chunk; gRPC's message limit is 4 MiB
constexpr size_t kMaxIdBytes = 128;
// The most local steps a round may ask for: the server's local_steps key is checked against it
// at config load, and a client refuses a task that asks for more.
constexpr int64_t kMaxLocalSteps = 10'000'000;

struct ParamSpec {
  std::string name;
  Shape shape;
};
using ParamSpecs = std::vector<ParamSpec>;

ParamSpecs param_specs(const model::Llama& model);
// Where the embedding and the untied output layer are among the specs (for row weighting).
TokenRowTensors token_row_tensors(const ParamSpecs& specs);
Weights model_weights(const model::Llama& model);                     // copies, float32
void set_model_weights(const model::Llama& model, const Weights& w);  // copies in

// Client ids: 1-128 characters of [A-Za-z0-9._-]; throws naming `what` otherwise.
void check_client_id(const std::string& id, const std::string& what);

// The model config as canonical JSON (sorted keys), what Join compares.
std::string model_config_json(const model::LlamaConfig& config);

// Empty when the client's proposal agrees with the server's; otherwise one line per difference
// ("model.hidden_size: server 256, client 128").
std::string agreement_differences(const pb::JoinRequest& client, uint32_t protocol,
                                  const std::string& model_config,
                                  const std::string& tokenizer_fingerprint);

// A tensor set ready to send.
struct EncodedSet {
  pb::TensorSetHeader header;
  std::string bytes;
};
EncodedSet encode_payloads(const ParamSpecs& specs, std::vector<std::string> payloads,
                           const CompressOptions& codec);
EncodedSet encode_weights(const ParamSpecs& specs, const Weights& w, const CompressOptions& codec);

// A scale format as a message names it: empty or "float32", or "bf16"; throws naming `what`.
ScaleFormat parse_wire_scale(const std::string& name, const std::string& what);

// Checks a received header against what is expected: the same tensors (names, order, shapes),
// the expected codec, and sizes that match the codec exactly. Throws naming `what`.
void validate_header(const pb::TensorSetHeader& h, const ParamSpecs& specs,
                     const CompressOptions& codec, const std::string& what);

// Calls send(chunk) for each chunk of at most max_chunk bytes, in order.
void for_each_chunk(const std::string& bytes, uint64_t max_chunk,
                    const std::function<void(const pb::Chunk&)>& send);

// Collects chunks of a stream whose header was validated: offsets must follow each other, no
// chunk may be empty or larger than kMaxChunkBytes, the total may not pass the header's, and
// finish() checks the total and the SHA-256.
class ChunkAssembler {
 public:
  // Reserved before any chunk arrives; the rest of the announced size once these have come.
  static constexpr uint64_t kReservedUpFront = 16 << 20;
  ChunkAssembler(const pb::TensorSetHeader& header, std::string what);
  void add(const pb::Chunk& chunk);
  std::string finish();  // the whole stream
  // The memory the stream holds now: what is reserved for it, arrived or not.
  uint64_t held_bytes() const { return bytes_.capacity(); }

 private:
  uint64_t total_;
  std::string sha256_, what_, bytes_;
};

// Decodes a validated, assembled stream into float32 tensors (checks every value).
Weights decode_set(const pb::TensorSetHeader& h, const std::string& bytes, const ParamSpecs& specs,
                   const std::string& what);

// Checks the update info of a push: id, round, tokens (training and evaluation) at most 2^50,
// losses and times finite, losses within +-kMaxLoss (negative for some post-training objectives),
// so that the server's weighted sums stay exact and finite.
constexpr double kMaxLoss = 1e9;
void validate_update_info(const pb::UpdateInfo& u, const std::string& what);

// The largest magnitude a decoded pseudo-gradient value may have. No training step moves a
// weight that far in one round; refusing such a value keeps every outer optimizer's step, and
// so the global model, inside float32's range whatever a client sends.
constexpr float kMaxUpdateValue = 1e6f;
// Refuses a value beyond kMaxUpdateValue, naming `what`, the tensor and the index.
void check_update_values(const ParamSpecs& specs, const Weights& delta, const std::string& what);

// Checks an update's token counts (row weighting): present exactly when `expected`, and then
// both as many counts as ids, ids strictly ascending below vocab_size, counts at least 1, each
// set summing to the update's tokens. Throws naming the field.
void validate_token_counts(const pb::UpdateInfo& u, bool expected, int64_t vocab_size,
                           const std::string& what);
TokenCounts token_counts_from(const pb::TokenCounts& c);
void token_counts_to(const TokenCounts& c, pb::TokenCounts* out);

}  // namespace pollen::fed
