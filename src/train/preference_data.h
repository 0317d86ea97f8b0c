#pragma once
// Preference data for DPO and reward models: JSONL records {"prompt", "chosen", "rejected"} (or
// {"prompt", "response"} to score), tokenized once. A prompt is text, or a list of messages
// ({"role", "content"}) rendered with the chat template up to the assistant's turn; a completion
// is text (the assistant's reply when the prompt is messages) or a list of messages that follow
// the prompt's. Special tokens written in the text (such as <|endoftext|>) are tokens.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "model/llama.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace pollen::train {

// One token sequence: a prompt and the completion after it, whose tokens are scored.
struct ScoredSequence {
  std::vector<uint32_t> ids;  // prompt then completion
  int64_t prompt_tokens = 0;
  bool shortened = false;  // longer than SequenceFormat::max_seq: lost tokens as it says
  int64_t completion_tokens() const { return static_cast<int64_t>(ids.size()) - prompt_tokens; }
};

struct PreferencePair {
  ScoredSequence chosen, rejected;
};

struct SequenceFormat {
  const tokenizer::Tokenizer* tokenizer = nullptr;
  std::optional<tokenizer::ChatFormat> chat_format;  // needed by prompts given as messages
  // Longest sequence: longer ones keep the completion's first tokens (at most max_seq - 1) and
  // the prompt's last tokens that fit beside them.
  int64_t max_seq = 0;
};

// Reads prompt/chosen/rejected records; errors name the file, line and field.
std::vector<PreferencePair> read_preference_pairs(const std::filesystem::path& path,
                                                  const SequenceFormat& format);
// Reads prompt/response records (for scoring).
std::vector<ScoredSequence> read_prompt_responses(const std::filesystem::path& path,
                                                  const SequenceFormat& format);

// Pairs of which the chosen or the rejected sequence was shortened to max_seq.
int64_t shortened_pairs(const std::vector<PreferencePair>& pairs);
// Logs how many pairs an objective ("dpo", "rm") trains and holds out, and how many of them were
// longer than max_seq positions.
void log_pair_counts(const std::string& objective, const std::vector<PreferencePair>& train,
                     const std::vector<PreferencePair>& validation, int64_t max_seq);

// Moves round(fraction * N) pairs (at least one, fewer than N), picked by the seed, out of
// `pairs` into the returned held-out set; both keep the file's order.
std::vector<PreferencePair> split_off_validation(std::vector<PreferencePair>& pairs,
                                                 double fraction, uint64_t seed,
                                                 const std::string& where);

// Sequences padded to the longest as one batch (B,T): targets are the next token at completion
// positions and negative elsewhere (prompt, padding); padding follows each sequence, so causal
// attention never lets it change the scored positions.
struct SequenceBatch {
  model::Batch batch;
  int64_t rows = 0;
  std::vector<int64_t> completion_tokens;  // (B): positions scored per row
  std::vector<int32_t> last_positions;     // (B): flat index b*T + len_b - 1 of each last token
  int64_t tokens = 0;                      // real (unpadded) tokens
};
SequenceBatch make_sequence_batch(const std::vector<const ScoredSequence*>& sequences,
                                  uint32_t pad_id);

// The pair indices of optimizer step `step` (1-based): `batch` consecutive places of an endless
// stream that visits every pair once per epoch, in an order shuffled per epoch from the seed.
std::vector<size_t> pairs_of_step(size_t num_pairs, int64_t batch, int64_t step, uint64_t seed);

// Chunks of at most `micro` consecutive indices.
std::vector<std::vector<size_t>> micro_batches(const std::vector<size_t>& indices, int64_t micro);

// The policy's batch for pairs: P chosen rows, then P rejected rows.
SequenceBatch pair_batch(const std::vector<PreferencePair>& pairs,
                         const std::vector<size_t>& indices, uint32_t pad_id);

}  // namespace pollen::train
