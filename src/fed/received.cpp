#include "fed/received.h"

#include <iterator>

#include "base/error.h"
#include "fed/first_moments.h"
#include "fed/post_lora.h"
#include "fed/secagg/masked_set.h"
#include "fed/second_moments.h"

namespace pollen::fed {
namespace {

// The tensors of an unmasked update's set: the pseudo-gradient's, then the first moments'.
ParamSpecs sent_specs(const UpdateRules& rules) {
  ParamSpecs all = rules.model;
  all.insert(all.end(), rules.first_moments.begin(), rules.first_moments.end());
  return all;
}

}  // namespace

void check_join_request(const pb::JoinRequest& r, const ServerTerms& terms) {
  check_client_id(r.client_id(), "join");
  POLLEN_CHECK(r.model_config().size() <= 4096 && r.tokenizer_fingerprint().size() <= 128 &&
                   r.data_manifest_hash().size() <= 128 && r.base_fingerprint().size() <= 128 &&
                   r.lora_config().size() <= 4096 && r.post_objective().size() <= 16,
               "join: oversized fields");
  std::string diff =
      agreement_differences(r, kProtocolVersion, terms.model_json, terms.tokenizer_fingerprint);
  const std::string post = post_agreement_differences(r, terms);
  if (!post.empty()) diff += (diff.empty() ? "" : "; ") + post;
  POLLEN_CHECK(diff.empty(), "client '", r.client_id(), "' disagrees with the server: ", diff);
}

void check_update_info(const pb::UpdateInfo& info, const UpdateRules& rules,
                       const std::string& what) {
  validate_update_info(info, what);
  if (!rules.negative_losses) {
    for (const auto& [name, loss] :
         {std::pair{"train_loss", info.train_loss()}, std::pair{"eval_loss", info.eval_loss()}}) {
      POLLEN_CHECK(loss >= 0, what, ": ", name, " ", loss,
                   " is negative; this federation's losses are cross-entropies");
    }
  }
  validate_token_counts(info, rules.token_counts, rules.vocab_size, what);
  if (rules.second_moments) {
    unpack_second_moments(rules.model, info.second_moments(), what);
  } else {
    POLLEN_CHECK(info.second_moments().empty(), what,
                 ": second moments the server did not ask for (strategy.second_moments)");
  }
}

void check_update_header(const pb::TensorSetHeader& header, const UpdateRules& rules,
                         const std::string& what) {
  if (rules.ring_bits > 0) {
    secagg::validate_masked_header(header, rules.masked, rules.ring_bits, what);
    return;
  }
  validate_header(header, sent_specs(rules), rules.codec, what);
}

UpdateTensors decode_update(const pb::TensorSetHeader& header, const std::string& bytes,
                            const UpdateRules& rules, const std::string& what) {
  Weights all = decode_set(header, bytes, sent_specs(rules), what);
  UpdateTensors u;
  const auto model_tensors = static_cast<std::ptrdiff_t>(rules.model.size());
  u.first_moments.assign(std::make_move_iterator(all.begin() + model_tensors),
                         std::make_move_iterator(all.end()));
  all.resize(rules.model.size());
  u.delta = std::move(all);
  check_update_values(rules.model, u.delta, what);
  check_first_moments(rules.first_moments, u.first_moments, what);
  return u;
}

TaskCodecs check_task(const pb::TaskReply& task) {
  POLLEN_CHECK(task.round() >= 1 && task.local_steps() >= 1 && task.local_steps() <= kMaxLocalSteps,
               "task: round ", task.round(), " with ", task.local_steps(), " local steps (1 to ",
               kMaxLocalSteps, ")");
  POLLEN_CHECK(task.model_sha256().empty() || task.model_sha256().size() == 64, "task of round ",
               task.round(), ": model_sha256 is not a SHA-256 hex digest");
  TaskCodecs c;
  c.update.codec = parse_codec(task.codec());
  c.update.block = task.codec_block();
  c.update.topk = task.codec_topk();
  c.update.scale = parse_wire_scale(task.codec_scale(), "the task's codec_scale");
  c.update.validate();
  // No model codec named: the whole model in float32, blocks as the upload's.
  c.model.codec = task.model_codec().empty() ? Codec::none : parse_codec(task.model_codec());
  c.model.block = task.model_codec().empty() ? c.update.block : task.model_codec_block();
  c.model.topk = task.model_codec_topk();
  c.model.scale = parse_wire_scale(task.model_codec_scale(), "the task's model_codec_scale");
  c.model.validate();
  return c;
}

}  // namespace pollen::fed
