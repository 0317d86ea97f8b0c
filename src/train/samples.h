#pragma once
// Text samples at each evaluation ([samples] in the run file): the model being trained continues
// a few prompts, so a team can read what it has learnt as well as watch its loss. Generation
// uses its own seeded sampler (model::generate), never the run's RNG or data, so a run with
// samples trains bitwise as one without. Each sample is logged, appended to RUN_DIR/samples.jsonl
// ({step, tokens, prompt, text, finish_reason}) and written as a TensorBoard text summary.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "model/generate.h"
#include "model/llama.h"
#include "obs/metrics.h"
#include "tokenizer/tokenizer.h"
#include "train/config.h"

namespace pollen::train {

// samples.tokenizer, else tokenizer.json beside the run's first data manifest (where
// `pollen data prepare` writes it); errors name the key when neither exists.
std::filesystem::path sample_tokenizer_path(const TrainConfig& config);

class SampleWriter {
 public:
  SampleWriter() = default;  // no prompts: writes nothing
  // Opens the tokenizer and RUN_DIR/samples.jsonl (cut back to `resume_at` when given).
  SampleWriter(const TrainConfig& config, std::optional<uint64_t> resume_at);

  bool enabled() const { return !prompts_.empty(); }
  // Continues every prompt with the model as it is now; `tb` may be closed.
  void write(const model::Llama& model, int64_t step, int64_t tokens, obs::EventFileWriter& tb);
  obs::AppendFile& file() { return jsonl_.file(); }

 private:
  std::vector<std::string> texts_;
  std::vector<std::vector<uint32_t>> prompts_;
  std::optional<tokenizer::Tokenizer> tokenizer_;
  model::SamplingOptions sampling_;
  obs::JsonlWriter jsonl_;
};

}  // namespace pollen::train
