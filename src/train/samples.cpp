#include "train/samples.h"

#include <algorithm>

#include "base/error.h"
#include "base/log.h"
#include "tokenizer/open.h"

namespace fs = std::filesystem;

namespace pollen::train {

fs::path sample_tokenizer_path(const TrainConfig& c) {
  if (!c.sample_tokenizer.empty()) {
    POLLEN_CHECK(fs::is_regular_file(c.sample_tokenizer), "samples.tokenizer: '",
                 c.sample_tokenizer, "' is not a file");
    return c.sample_tokenizer;
  }
  const fs::path beside = fs::path(c.manifests.front()).parent_path() / "tokenizer.json";
  POLLEN_CHECK(fs::is_regular_file(beside), "samples.prompts needs a tokenizer: there is no '",
               beside.string(), "' beside the first data manifest; set samples.tokenizer");
  return beside;
}

SampleWriter::SampleWriter(const TrainConfig& c, std::optional<uint64_t> resume_at) {
  if (c.sample_prompts.empty()) return;
  tokenizer_ = tokenizer::open_tokenizer(sample_tokenizer_path(c), "");
  texts_ = c.sample_prompts;
  // Documents were tokenised without BOS and end in the tokenizer's end-of-text token
  // (`pollen data prepare`), so prompts are plain text and that token ends a sample.
  for (const auto& t : tokenizer_->added_tokens())
    if (t.special && (t.content == "<|endoftext|>" || t.content == "<|end_of_text|>" ||
                      t.content == "</s>" || t.content == "<eos>"))
      sampling_.stop_tokens.push_back(t.id);
  for (const auto& text : texts_) {
    prompts_.push_back(tokenizer_->encode(text));
    POLLEN_CHECK(!prompts_.back().empty(), "samples.prompts: prompt \"", text,
                 "\" encodes to no tokens");
    const int64_t need = static_cast<int64_t>(prompts_.back().size()) + c.sample_max_tokens;
    POLLEN_CHECK(need <= c.model.max_position_embeddings, "samples.max_tokens: prompt \"", text,
                 "\" (", prompts_.back().size(), " tokens) plus ", c.sample_max_tokens,
                 " new tokens exceeds the model's max_position_embeddings (",
                 c.model.max_position_embeddings, ")");
  }
  sampling_.max_tokens = c.sample_max_tokens;
  sampling_.temperature = c.sample_temperature;
  sampling_.top_k = c.sample_top_k;
  sampling_.seed = c.sample_seed;
  // A model's vocabulary is often padded beyond its tokenizer's: those ids have no text.
  sampling_.vocab_size = static_cast<int64_t>(tokenizer_->vocab_size());
  jsonl_ = obs::JsonlWriter(c.dir / "samples.jsonl", resume_at, obs::Shortfall::keep_whole_lines);
}

void SampleWriter::write(const model::Llama& model, int64_t step, int64_t tokens,
                         obs::EventFileWriter& tb) {
  if (!enabled()) return;
  const auto decode = [this](std::span<const uint32_t> ids) { return tokenizer_->decode(ids); };
  const auto out = model::generate(model, prompts_, sampling_, decode);
  const double wall = obs::wall_time_now();
  std::string markdown;
  for (size_t i = 0; i < out.size(); ++i) {
    nlohmann::ordered_json j;
    j["step"] = step;
    j["tokens"] = tokens;
    j["prompt"] = texts_[i];
    j["text"] = out[i].text;
    j["finish_reason"] = out[i].finish_reason;
    jsonl_.write(j);
    log::info("step ", step, " sample ", i + 1, ": ",
              nlohmann::json(texts_[i] + out[i].text)
                  .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    markdown += (i ? "\n\n" : "") + cat("**", texts_[i], "**", out[i].text);
  }
  jsonl_.file().flush();
  if (tb.file().is_open()) tb.add_text("samples", markdown, step, wall);
}

}  // namespace pollen::train
