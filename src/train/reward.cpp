#include "train/reward.h"

#include <fstream>
#include <map>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "base/rng.h"
#include "io/hf.h"
#include "io/model_source.h"
#include "io/safetensors.h"
#include "tokenizer/open.h"
#include "train/config.h"
#include "train/jsonl_data.h"

namespace pollen::train {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

void refuse_pad_token(const std::vector<PreferencePair>& pairs, uint32_t pad,
                      const fs::path& file) {
  for (size_t i = 0; i < pairs.size(); ++i)
    for (const ScoredSequence* s : {&pairs[i].chosen, &pairs[i].rejected})
      for (uint32_t id : s->ids)
        POLLEN_CHECK(id != pad, "'", file.string(), "' record ", i + 1,
                     " contains the pad token (id ", pad,
                     "): a sequence-classification model scores the token before the first pad; "
                     "choose another [rm] pad_token");
}

}  // namespace

uint32_t pad_token_named(const tokenizer::Tokenizer& tokenizer, const std::string& token,
                         const std::string& where) {
  for (const auto& t : tokenizer.added_tokens())
    if (t.content == token) return t.id;
  fail(where, ": the tokenizer has no added token \"", token, "\"");
}

ag::Var sequence_rewards(const model::Llama& model, const ag::Var& score,
                         const SequenceBatch& batch) {
  const ag::Var h = model.hidden_states(batch.batch);  // (B*T,C)
  const Tensor last = Tensor::from<int32_t>({batch.rows}, batch.last_positions);
  const ag::Var h_last = ag::embedding(h, last);  // (B,C): rows of h at the last tokens
  return ag::reshape(ag::linear(h_last, score), {batch.rows});  // (B,1) -> (B)
}

RewardObjective::RewardObjective(ObjectiveContext context) : context_(std::move(context)) {
  ConfigTable& s = context_.section;
  const fs::path data = resolve_config_path(context_.base_dir, s.require_string("data"));
  const std::string validation = s.get_string("validation", "");
  const double validation_fraction = s.get_double("validation_fraction", 0.0);
  POLLEN_CHECK(validation.empty() != (validation_fraction == 0), s.where("validation"),
               ": held-out pairs come from validation (a file) or validation_fraction (of data); "
               "set exactly one");
  batch_pairs_ = s.get_int("batch_pairs", 8);
  POLLEN_CHECK(batch_pairs_ > 0, s.where("batch_pairs"), ": expected a positive integer");
  micro_batch_pairs_ = s.get_int("micro_batch_pairs", 4);
  POLLEN_CHECK(micro_batch_pairs_ > 0, s.where("micro_batch_pairs"),
               ": expected a positive integer");
  POLLEN_CHECK(context_.tokenizer != nullptr, "rm: no tokenizer");
  pad_token_id_ = rm_pad_token_id(s, *context_.tokenizer);
  s.finish();

  const fs::path eval_path = validation.empty()
                                 ? fs::path()
                                 : fs::path(resolve_config_path(context_.base_dir, validation));

  const SequenceFormat format{context_.tokenizer, context_.chat_format, context_.max_seq};
  train_pairs_ = read_preference_pairs(data, format);
  refuse_pad_token(train_pairs_, pad_token_id_, data);
  if (!validation.empty()) {
    if (jsonl_has_records(eval_path)) {
      eval_pairs_ = read_preference_pairs(eval_path, format);
      refuse_pad_token(eval_pairs_, pad_token_id_, eval_path);
    }
  } else {
    eval_pairs_ = split_off_validation(train_pairs_, validation_fraction, context_.seed,
                                       s.where("validation_fraction"));
  }
  log_pair_counts("rm", train_pairs_, eval_pairs_, context_.max_seq);

  identity_.emplace("rm.data", data, "rm.validation", eval_path, context_);  // the files read well
  score_ = ag::Var(initial_score_head(context_.model_config, context_.seed), true, "score.weight");
}

uint32_t rm_pad_token_id(ConfigTable& section, const tokenizer::Tokenizer& tokenizer) {
  const std::string pad = section.get_string("pad_token", "<|endoftext|>");
  return pad_token_named(tokenizer, pad, section.where("pad_token"));
}

Tensor initial_score_head(const model::LlamaConfig& config, uint64_t seed) {
  const int64_t c = config.hidden_size;
  Tensor w = Tensor::empty({1, c}, DType::f32);
  Rng rng = Rng(seed).fork(0x5c0e);
  for (int64_t i = 0; i < c; ++i)
    w.data<float>()[i] = static_cast<float>(config.initializer_range * rng.normal());
  return w;
}

PreferenceStats RewardObjective::run_pairs(const model::Llama& model,
                                           const std::vector<PreferencePair>& pairs,
                                           const std::vector<size_t>& indices, double scale,
                                           bool backward, int64_t* tokens) const {
  // Bradley-Terry is the sigmoid preference loss on rewards with beta 1 and no reference.
  const PreferenceLossOptions bradley_terry{PreferenceLossKind::sigmoid, 1.0, 0.0};
  PreferenceStats stats;
  const auto chunks = micro_batches(indices, micro_batch_pairs_);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const std::vector<size_t>& chunk = chunks[c];
    if (!share_.runs(c, model)) continue;
    const SequenceBatch batch = pair_batch(pairs, chunk, pad_token_id_);
    const std::vector<double> no_reference(2 * chunk.size(), 0.0);
    *tokens += batch.tokens;
    if (backward) {
      ag::Tape tape;
      ag::Var loss;
      {
        ag::TapeScope scope(tape);
        loss = preference_loss(sequence_rewards(model, score_, batch), no_reference,
                               batch.completion_tokens, bradley_terry, scale, &stats);
      }
      tape.backward(loss);
    } else {
      ag::NoGrad no_grad;
      preference_loss(sequence_rewards(model, score_, batch), no_reference, batch.completion_tokens,
                      bradley_terry, scale, &stats);
    }
  }
  if (share_.comm) {
    if (backward) share_.reducer->finish();  // the gradients summed over the ranks
    stats.sum_over(*share_.comm, *tokens);
  }
  return stats;
}

namespace {
ObjectiveStep reward_report(const PreferenceStats& stats, int64_t tokens) {
  ObjectiveStep out;
  const double n = static_cast<double>(std::max<int64_t>(stats.pairs, 1));
  out.loss = stats.loss / n;
  out.tokens = tokens;
  out.metrics["accuracy"] = stats.correct / n;
  out.metrics["rewards/chosen"] = stats.chosen_rewards / n;
  out.metrics["rewards/rejected"] = stats.rejected_rewards / n;
  out.metrics["rewards/margins"] = (stats.chosen_rewards - stats.rejected_rewards) / n;
  return out;
}
}  // namespace

ObjectiveStep RewardObjective::train_step(const model::Llama& model, int64_t step) {
  const auto indices = pairs_of_step(train_pairs_.size(), batch_pairs_, step, context_.seed);
  int64_t tokens = 0;
  const PreferenceStats stats = run_pairs(model, train_pairs_, indices,
                                          1.0 / static_cast<double>(batch_pairs_), true, &tokens);
  return reward_report(stats, tokens);
}

ObjectiveStep RewardObjective::evaluate(const model::Llama& model) {
  std::vector<size_t> all(eval_pairs_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  int64_t tokens = 0;
  const PreferenceStats stats = run_pairs(
      model, eval_pairs_, all, 1.0 / static_cast<double>(eval_pairs_.size()), false, &tokens);
  return reward_report(stats, tokens);
}

void RewardObjective::restore(const nlohmann::ordered_json& state) {
  identity_->check(state, "rm");
}

std::unique_ptr<Objective> make_reward_objective(ObjectiveContext context) {
  return std::make_unique<RewardObjective>(std::move(context));
}

namespace {

// A file of the export that is not the weights nor config.json: its name and its bytes.
using SideFile = std::pair<std::string, std::string>;

// Every file written atomically: the weights first, then the side files, and config.json last,
// so that an export cut short (a full disk) leaves no torn file and no new config.json beside
// old weights.
void write_reward_model(const model::Llama& decoder, const ag::Var& score, uint32_t pad_token_id,
                        const fs::path& dir, const std::vector<SideFile>& side_files) {
  fs::create_directories(dir);
  json config = io::hf_config_json(decoder.config());
  config["architectures"] = {"LlamaForSequenceClassification"};
  config["id2label"] = {{"0", "LABEL_0"}};
  config["label2id"] = {{"LABEL_0", 0}};
  config["pad_token_id"] = pad_token_id;
  io::NamedTensors tensors;
  for (const auto& [name, v] : decoder.named_parameters())
    if (name.starts_with("model.")) tensors.emplace_back(name, v.value().to(DType::f32));
  tensors.emplace_back("score.weight", score.value().to(DType::f32));
  io::write_safetensors_atomic(dir / "model.safetensors", tensors, {{"format", "pt"}});
  for (const auto& [name, bytes] : side_files) write_file_atomic(dir / name, bytes);
  write_file_atomic(dir / "config.json", config.dump(2) + "\n");
}

std::vector<SideFile> read_side_files(const std::vector<fs::path>& files) {
  std::vector<SideFile> out;
  for (const fs::path& f : files) out.emplace_back(f.filename().string(), read_file(f));
  return out;
}

}  // namespace

void export_reward_model(const model::Llama& decoder, const ag::Var& score, uint32_t pad_token_id,
                         const fs::path& dir, const std::vector<fs::path>& extra_files) {
  write_reward_model(decoder, score, pad_token_id, dir, read_side_files(extra_files));
}

void export_reward_checkpoint(const fs::path& checkpoint, uint32_t pad_token_id,
                              const fs::path& dir) {
  const io::ModelSource source = io::resolve_model(checkpoint.string());
  const model::Llama decoder = io::load_model(source);
  const fs::path head_file = source.path / "objective.safetensors";
  const io::SafetensorsFile head = io::read_safetensors(head_file);
  const Tensor* score = head.find("score.weight");
  POLLEN_CHECK(score != nullptr, "'", head_file.string(),
               "' has no score.weight: not a reward model's checkpoint");
  POLLEN_CHECK(source.tokenizer.has_value(), "checkpoint '", checkpoint.string(),
               "' has no tokenizer.json");
  export_reward_model_with_tokenizer(decoder, ag::Var(score->to(DType::f32)), pad_token_id,
                                     *source.tokenizer, dir);
}

void export_reward_model_with_tokenizer(const model::Llama& decoder, const ag::Var& score,
                                        uint32_t pad_token_id, const fs::path& tokenizer_json,
                                        const fs::path& dir) {
  fs::create_directories(dir);
  const tokenizer::Tokenizer tok = tokenizer::open_tokenizer(tokenizer_json, "");
  std::string pad;
  for (const auto& t : tok.added_tokens())
    if (t.id == pad_token_id) pad = t.content;
  json tokenizer_config = io::hf_tokenizer_config(decoder.config().max_position_embeddings);
  tokenizer_config["pad_token"] = pad;
  // Under the name transformers and pollen rm score look for, whatever the run called it.
  std::vector<SideFile> side_files = {{"tokenizer.json", read_file(tokenizer_json)},
                                      {"tokenizer_config.json", tokenizer_config.dump(2) + "\n"}};
  write_reward_model(decoder, score, pad_token_id, dir, side_files);
}

RewardModel load_reward_model(const fs::path& dir) {
  const fs::path config_path = dir / "config.json";
  nlohmann::json config;
  const std::string config_text = read_file(config_path);
  check_json_depth(config_text, cat("'", config_path.string(), "'"));
  try {
    config = nlohmann::json::parse(config_text);
  } catch (const nlohmann::json::exception& e) {
    fail("'", config_path.string(), "' is not valid JSON: ", e.what());
  }
  POLLEN_CHECK(config.is_object(), "'", config_path.string(), "': expected a JSON object");
  const auto arch = config.value("architectures", nlohmann::json::array());
  POLLEN_CHECK(arch.is_array() && arch.size() == 1 && arch[0] == "LlamaForSequenceClassification",
               "'", config_path.string(),
               "': expected architectures [\"LlamaForSequenceClassification\"] (a reward model)");
  const auto labels = config.value("id2label", nlohmann::json::object());
  POLLEN_CHECK(labels.is_object() && labels.size() == 1, "'", config_path.string(),
               "': expected one label (num_labels 1): a reward model gives one score");
  POLLEN_CHECK(config.contains("pad_token_id") && config["pad_token_id"].is_number_unsigned(), "'",
               config_path.string(), "': expected pad_token_id (a token id)");
  RewardModel rm;
  rm.pad_token_id = config["pad_token_id"].get<uint32_t>();
  for (const char* key : {"id2label", "label2id", "num_labels", "problem_type"}) config.erase(key);
  model::LlamaConfig c = io::parse_hf_config(config, config_path.string());
  c.tie_word_embeddings = true;  // the LM head is not part of a sequence-classification model

  const fs::path weights = dir / "model.safetensors";
  io::SafetensorsFile file = io::read_safetensors(weights);
  auto take = [&](const std::string& name, const Shape& shape) {
    const Tensor* t = file.find(name);
    POLLEN_CHECK(t != nullptr, "'", weights.string(), "': missing tensor '", name, "'");
    POLLEN_CHECK(t->shape() == shape, "'", weights.string(), "': tensor '", name, "' has shape ",
                 shape_str(t->shape()), ", expected ", shape_str(shape));
    return t->to(DType::f32);
  };
  rm.decoder = std::make_unique<model::Llama>(c, take);
  rm.score = ag::Var(take("score.weight", {1, c.hidden_size}), false, "score.weight");
  return rm;
}

std::vector<double> score_sequences(const model::Llama& decoder, const ag::Var& score,
                                    const std::vector<ScoredSequence>& sequences,
                                    int64_t micro_batch) {
  ag::NoGrad no_grad;
  std::vector<double> out;
  for (size_t i = 0; i < sequences.size(); i += static_cast<size_t>(micro_batch)) {
    std::vector<const ScoredSequence*> rows;
    for (size_t j = i; j < std::min(sequences.size(), i + static_cast<size_t>(micro_batch)); ++j)
      rows.push_back(&sequences[j]);
    for (double r :
         sequence_rewards(decoder, score, make_sequence_batch(rows, 0)).value().to_doubles())
      out.push_back(r);
  }
  return out;
}

ScoreCounts score_jsonl(const RewardModel& rm, const SequenceFormat& format, const fs::path& in,
                        const fs::path& out, int64_t micro_batch) {
  const std::vector<ScoredSequence> sequences = read_prompt_responses(in, format);
  for (size_t i = 0; i < sequences.size(); ++i)
    for (uint32_t id : sequences[i].ids)
      POLLEN_CHECK(id != rm.pad_token_id, "'", in.string(), "' record ", i + 1,
                   " contains the model's pad token (id ", rm.pad_token_id, ")");
  const std::vector<double> scores = score_sequences(*rm.decoder, rm.score, sequences, micro_batch);
  std::ifstream lines(in, std::ios::binary);
  std::string line, text;
  size_t i = 0;
  while (std::getline(lines, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json record = json::parse(line);
    record["score"] = scores.at(i++);
    text += record.dump() + "\n";
  }
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  write_file_atomic(out, text);
  return {static_cast<int64_t>(sequences.size()),
          std::ranges::count_if(sequences, [](const ScoredSequence& s) { return s.shortened; })};
}

}  // namespace pollen::train
