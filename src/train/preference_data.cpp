#include "train/preference_data.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "base/error.h"
#include "base/log.h"
#include "base/rng.h"
#include "train/jsonl_data.h"

namespace pollen::train {
namespace {

using json = nlohmann::json;

// The prompt's text and the completion's text after it.
std::pair<std::string, std::string> render(const json& prompt, const json& completion,
                                           const SequenceFormat& format, const std::string& where,
                                           const std::string& completion_field) {
  if (prompt.is_string()) {
    POLLEN_CHECK(completion.is_string(), where, ": field '", completion_field,
                 "' must be text when 'prompt' is text");
    return {prompt.get<std::string>(), completion.get<std::string>()};
  }
  POLLEN_CHECK(prompt.is_array(), where, ": field 'prompt' must be text or a list of messages");
  POLLEN_CHECK(format.chat_format.has_value(), where,
               ": the prompt is a list of messages, but no chat template is known to render it "
               "(the model's tokenizer_config.json names none; set model.chat_template in the "
               "run file, or --chat-template for rm score)");
  const auto prompt_messages = read_messages(prompt, "prompt", where);
  auto all = prompt_messages;
  if (completion.is_string()) {
    all.push_back({"assistant", completion.get<std::string>()});
  } else {
    POLLEN_CHECK(completion.is_array(), where, ": field '", completion_field,
                 "' must be text or a list of messages");
    for (auto& m : read_messages(completion, completion_field, where)) all.push_back(std::move(m));
  }
  std::string prompt_text = render_chat(*format.chat_format, prompt_messages, true);
  std::string full = render_chat(*format.chat_format, all, false);
  POLLEN_CHECK(full.starts_with(prompt_text), where, ": field '", completion_field,
               "' does not continue the prompt under the chat template (it must be the "
               "assistant's turn)");
  return {std::move(prompt_text), full.substr(prompt_text.size())};
}

// `completion_field`: the record's field the completion came from ("chosen", say).
ScoredSequence encode(const std::pair<std::string, std::string>& texts,
                      const SequenceFormat& format, const std::string& where,
                      const std::string& completion_field) {
  const tokenizer::EncodeOptions options{tokenizer::SpecialPolicy::allow_all(), false};
  std::vector<uint32_t> prompt = format.tokenizer->encode(texts.first, options);
  std::vector<uint32_t> completion = format.tokenizer->encode(texts.second, options);
  POLLEN_CHECK(!prompt.empty(), where, ": field 'prompt' has no token");
  POLLEN_CHECK(!completion.empty(), where, ": field '", completion_field, "' has no token");
  ScoredSequence s;
  if (format.max_seq > 0 &&
      prompt.size() + completion.size() > static_cast<size_t>(format.max_seq)) {
    const size_t max_seq = static_cast<size_t>(format.max_seq);
    if (completion.size() > max_seq - 1) completion.resize(max_seq - 1);
    const size_t keep = std::min(prompt.size(), max_seq - completion.size());
    prompt.erase(prompt.begin(), prompt.end() - static_cast<std::ptrdiff_t>(keep));
    s.shortened = true;
  }
  s.prompt_tokens = static_cast<int64_t>(prompt.size());
  s.ids = std::move(prompt);
  s.ids.insert(s.ids.end(), completion.begin(), completion.end());
  return s;
}

// Calls fn(record, where) for each record of a JSONL file, once it has every one of `fields`.
template <typename F>
void for_each_record(const std::filesystem::path& path, const std::vector<std::string>& fields,
                     F&& fn) {
  for_each_jsonl_object(path, "data", [&](const json& record, int64_t, const std::string& where) {
    for (const auto& f : fields)
      POLLEN_CHECK(record.contains(f), where, ": missing field '", f, "'");
    fn(record, where);
  });
}

}  // namespace

std::vector<PreferencePair> read_preference_pairs(const std::filesystem::path& path,
                                                  const SequenceFormat& format) {
  std::vector<PreferencePair> pairs;
  for_each_record(path, {"prompt", "chosen", "rejected"}, [&](const json& r, const std::string& w) {
    // TRL's reward trainer reads a margin per pair; pollen's loss has none, so a file that gives
    // one would train otherwise than its author meant.
    POLLEN_CHECK(!r.contains("margin"), w,
                 ": has a \"margin\"; pollen's preference losses have no margin term (remove "
                 "the field to train without it)");
    pairs.push_back(
        {encode(render(r["prompt"], r["chosen"], format, w, "chosen"), format, w, "chosen"),
         encode(render(r["prompt"], r["rejected"], format, w, "rejected"), format, w, "rejected")});
  });
  return pairs;
}

std::vector<ScoredSequence> read_prompt_responses(const std::filesystem::path& path,
                                                  const SequenceFormat& format) {
  std::vector<ScoredSequence> out;
  for_each_record(path, {"prompt", "response"}, [&](const json& r, const std::string& w) {
    out.push_back(
        encode(render(r["prompt"], r["response"], format, w, "response"), format, w, "response"));
  });
  return out;
}

int64_t shortened_pairs(const std::vector<PreferencePair>& pairs) {
  return std::ranges::count_if(
      pairs, [](const PreferencePair& p) { return p.chosen.shortened || p.rejected.shortened; });
}

void log_pair_counts(const std::string& objective, const std::vector<PreferencePair>& train,
                     const std::vector<PreferencePair>& validation, int64_t max_seq) {
  const int64_t shortened = shortened_pairs(train) + shortened_pairs(validation);
  log::info(objective, ": ", train.size(), " training and ", validation.size(),
            " validation pairs; ",
            shortened == 0 ? cat("none longer than ", max_seq, " positions")
                           : cat(shortened, " longer than ", max_seq,
                                 " positions, shortened to them (the completion's first tokens "
                                 "and the prompt's last kept)"));
}

std::vector<PreferencePair> split_off_validation(std::vector<PreferencePair>& pairs,
                                                 double fraction, uint64_t seed,
                                                 const std::string& where) {
  POLLEN_CHECK(fraction > 0 && fraction < 1, where, ": expected a number in (0, 1)");
  const size_t n = pairs.size();
  const size_t held = std::max<size_t>(1, static_cast<size_t>(std::llround(fraction * n)));
  POLLEN_CHECK(held < n, where, ": holding out ", held, " of ", n,
               " pairs leaves none to train on");
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  Rng rng = Rng(seed).fork(0x7a11d);
  for (size_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  std::vector<bool> is_held(n, false);
  for (size_t i = 0; i < held; ++i) is_held[order[i]] = true;
  std::vector<PreferencePair> train, validation;
  for (size_t i = 0; i < n; ++i) (is_held[i] ? validation : train).push_back(std::move(pairs[i]));
  pairs = std::move(train);
  return validation;
}

SequenceBatch make_sequence_batch(const std::vector<const ScoredSequence*>& sequences,
                                  uint32_t pad_id) {
  SequenceBatch out;
  out.rows = static_cast<int64_t>(sequences.size());
  int64_t t = 1;
  for (const ScoredSequence* s : sequences) t = std::max<int64_t>(t, std::ssize(s->ids));
  Tensor tokens = Tensor::full({out.rows, t}, pad_id, DType::i32);
  Tensor targets = Tensor::full({out.rows, t}, -100, DType::i32);
  int32_t* tk = tokens.data<int32_t>();
  int32_t* tg = targets.data<int32_t>();
  for (int64_t b = 0; b < out.rows; ++b) {
    const ScoredSequence& s = *sequences[static_cast<size_t>(b)];
    const int64_t len = std::ssize(s.ids);
    for (int64_t j = 0; j < len; ++j) {
      tk[b * t + j] = static_cast<int32_t>(s.ids[static_cast<size_t>(j)]);
      // Position j predicts token j+1, scored when that token belongs to the completion.
      if (j + 1 < len && j + 1 >= s.prompt_tokens)
        tg[b * t + j] = static_cast<int32_t>(s.ids[static_cast<size_t>(j + 1)]);
    }
    out.completion_tokens.push_back(s.completion_tokens());
    out.last_positions.push_back(static_cast<int32_t>(b * t + len - 1));
    out.tokens += len;
  }
  out.batch = model::Batch::contiguous_rows(tokens, targets);
  return out;
}

std::vector<size_t> pairs_of_step(size_t num_pairs, int64_t batch, int64_t step, uint64_t seed) {
  POLLEN_CHECK(num_pairs > 0 && batch > 0 && step > 0, "pairs_of_step: bad arguments");
  std::vector<size_t> out;
  std::vector<size_t> order;
  uint64_t order_epoch = UINT64_MAX;
  const uint64_t first = static_cast<uint64_t>(step - 1) * static_cast<uint64_t>(batch);
  for (uint64_t place = first; place < first + static_cast<uint64_t>(batch); ++place) {
    const uint64_t epoch = place / num_pairs;
    if (epoch != order_epoch) {  // Fisher-Yates from the epoch's own stream
      order.resize(num_pairs);
      std::iota(order.begin(), order.end(), size_t{0});
      Rng rng = Rng(seed).fork(epoch);
      for (size_t i = num_pairs - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
      order_epoch = epoch;
    }
    out.push_back(order[place % num_pairs]);
  }
  return out;
}

std::vector<std::vector<size_t>> micro_batches(const std::vector<size_t>& indices, int64_t micro) {
  std::vector<std::vector<size_t>> out;
  for (size_t i = 0; i < indices.size(); i += static_cast<size_t>(micro))
    out.emplace_back(indices.begin() + static_cast<std::ptrdiff_t>(i),
                     indices.begin() + static_cast<std::ptrdiff_t>(std::min(
                                           indices.size(), i + static_cast<size_t>(micro))));
  return out;
}

SequenceBatch pair_batch(const std::vector<PreferencePair>& pairs,
                         const std::vector<size_t>& indices, uint32_t pad_id) {
  std::vector<const ScoredSequence*> rows;
  for (size_t i : indices) rows.push_back(&pairs[i].chosen);
  for (size_t i : indices) rows.push_back(&pairs[i].rejected);
  return make_sequence_batch(rows, pad_id);
}

}  // namespace pollen::train
