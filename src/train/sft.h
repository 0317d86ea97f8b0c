#pragma once
// Supervised fine-tuning (`pollen sft`): conversations (OpenAI-style {"messages": [{"role",
// "content"}, ...]}) or {"prompt", "completion"} pairs, rendered with the model's chat template,
// the loss on the assistant's tokens only (or on every token), several examples packed per row
// with positions and attention reset at each example's start, and rows batched without padding
// beyond the longest row of a micro-batch. docs/posttraining.md, section [sft].
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/rng.h"
#include "model/llama.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "train/data_key.h"
#include "train/objective.h"

namespace pollen::train {

// One line of an SFT JSONL file, as messages (a prompt/completion pair becomes a user and an
// assistant message).
struct SftRecord {
  std::vector<tokenizer::ChatMessage> messages;
  int64_t line = 0;  // 1-based, for errors
};
// Reads every non-empty line; a malformed line is refused naming the file, the line and the
// field ("messages[1].content: expected a string").
std::vector<SftRecord> read_sft_jsonl(const std::filesystem::path& path);

// A tokenised example: `scored[i]` says whether token i is a loss target (predicted from the
// tokens before it).
struct SftExample {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> scored;
  int64_t scored_count() const;
};

// The conversation rendered with `format` and tokenised (special tokens allowed, no BOS/EOS
// template: the chat template writes what the model wants). With `assistant_only`, exactly the
// tokens of each assistant message's content and of the end-of-turn token that closes it are
// scored (what the model must generate), found by rendering the conversation up to each
// assistant turn and checking that it ends on a token boundary of the whole; otherwise every
// token after the first is scored. `where` names the example in errors.
SftExample tokenize_conversation(const tokenizer::Tokenizer& tok,
                                 const tokenizer::ChatFormat& format,
                                 const std::vector<tokenizer::ChatMessage>& messages,
                                 bool assistant_only, const std::string& where);

// Greedy packing: examples taken in `order` fill rows of at most `seq` positions (an example of
// n tokens takes n - 1: inputs 0..n-2 predict 1..n-1); an example that does not fit the rest of
// the row starts a new row. Returns the rows as lists of example indices.
std::vector<std::vector<int64_t>> pack_rows(const std::vector<SftExample>& examples,
                                            const std::vector<int64_t>& order, int64_t seq);

// The batch of some packed rows: tokens, targets (-1 where not scored), positions restarting at
// 0 and a new doc id at each example; rows shorter than the longest are padded with unscored
// positions of their own document.
model::Batch make_packed_batch(const std::vector<SftExample>& examples,
                               const std::vector<std::vector<int64_t>>& rows);

struct SftSettings {
  std::filesystem::path data;        // training JSONL
  std::filesystem::path validation;  // held-out JSONL; empty: a fraction of data by hash
  double validation_fraction = 0.05;
  bool assistant_only = true;  // loss_on = "assistant" (or "all")
  int64_t seq = 0;             // positions per packed row; 0: the model's maximum
  int64_t micro_batch = 4;     // rows per micro-batch
  int64_t accumulation = 1;    // micro-batches per optimizer step
  bool pack = true;            // false: one example per row
  bool drop_long = false;      // too_long = "drop" (else "truncate")
};
SftSettings read_sft_settings(ConfigTable& section, const std::filesystem::path& base_dir,
                              int64_t max_seq);

class SftObjective : public Objective {
 public:
  explicit SftObjective(const ObjectiveContext& context);

  std::string name() const override { return "sft"; }
  ObjectiveStep train_step(const model::Llama& model, int64_t step) override;
  ObjectiveStep evaluate(const model::Llama& model) override;
  std::string no_validation_data() const override;
  // Rank r of W runs micro-batches [r A / W, (r + 1) A / W) of a step's A (sft.accumulation, a
  // multiple of W) and every W-th held-out micro-batch from r.
  void split_across(dist::Communicator& comm, dist::GradReducer& reducer) override;
  nlohmann::ordered_json state() const override;
  void restore(const nlohmann::ordered_json& state) override;

  const std::vector<SftExample>& train_examples() const { return train_; }

 private:
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  std::vector<int64_t> next_row();  // the next packed row of the training data

  SftSettings settings_;
  std::optional<DataIdentity> identity_;  // the data files, tokenizer and template
  uint64_t seed_;
  std::vector<SftExample> train_, validation_;
  std::vector<std::vector<int64_t>> validation_rows_;
  // Position in the data: the epoch and the next example of its order.
  int64_t epoch_ = 0, next_ = 0;
  std::vector<int64_t> order_;
  dist::Communicator* comm_ = nullptr;  // several ranks (split_across); null: this process alone
  dist::GradReducer* reducer_ = nullptr;
};

std::unique_ptr<Objective> make_sft_objective(const ObjectiveContext& context);

}  // namespace pollen::train
