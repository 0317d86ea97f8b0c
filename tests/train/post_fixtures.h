#pragma once
// Shared by the post-training tests: a tiny byte-level tokenizer with the chat templates'
// special tokens, a tiny model file, synthetic conversations, and a run file over them.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/open.h"
#include "tokenizer/trainer.h"
#include "train/post_config.h"
#include "train/post_run.h"
#include "train/run_checks.h"
#include "train/synth_tasks.h"

namespace pollen::test_support {

// A fresh folder unique to this process.
inline std::filesystem::path post_temp_dir(const std::string& name) {
  namespace fs = std::filesystem;
  fs::path d = fs::temp_directory_path() / ("pollen_post_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// ChatML's and Llama 3's special tokens.
inline std::vector<std::string> chat_special_tokens() {
  return {"<|im_start|>",      "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
          "<|end_header_id|>", "<|eot_id|>", "<|endoftext|>"};
}

// A BPE tokenizer (Llama 3's pre-tokenisation pattern, 320 ids) trained on the synthetic tasks'
// text, saved as dir/tokenizer.json.
inline std::filesystem::path make_chat_tokenizer(const std::filesystem::path& dir) {
  const std::string pattern = tokenizer::pattern_regex("cl100k_base");
  tokenizer::PieceCounts counts(pattern);
  std::vector<std::string> texts;
  for (const auto& task : train::synth_task_names())
    for (const auto& e : train::synth_examples(task, 200, 99)) {
      texts.push_back(e.prompt);
      texts.push_back(e.completion);
    }
  texts.push_back("user\nassistant\nsystem\n\n");
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  counts.add_documents(views);
  const auto tok = tokenizer::train_bpe(counts, {320, chat_special_tokens(), pattern});
  const auto path = dir / "tokenizer.json";
  tokenizer::save_tokenizer(tok, path);
  return path;
}

// A model file for a tiny Llama over that tokenizer.
inline std::filesystem::path make_tiny_model_file(const std::filesystem::path& dir,
                                                  int max_positions = 128) {
  const auto path = dir / "tiny-model.toml";
  std::ofstream(path) << "[model]\nname = \"tiny-chat\"\nvocab_size = 320\nhidden_size = 32\n"
                         "intermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 2\n"
                         "num_key_value_heads = 1\nmax_position_embeddings = "
                      << max_positions << "\n";
  return path;
}

// A fresh folder (post_temp_dir) holding the tokenizer and the tiny model file.
struct PostFiles {
  std::filesystem::path dir, tokenizer_path, model_file;
};
inline PostFiles make_post_files(const std::string& name) {
  PostFiles f;
  f.dir = post_temp_dir(name);
  f.tokenizer_path = make_chat_tokenizer(f.dir);
  f.model_file = make_tiny_model_file(f.dir);
  return f;
}

// `count` synthetic conversations of `task` as SFT JSONL.
inline std::filesystem::path write_sft_data(const std::filesystem::path& file,
                                            const std::string& task, int count, uint64_t seed) {
  std::ofstream out(file);
  for (const auto& e : train::synth_examples(task, count, seed))
    out << train::sft_jsonl_line(e) << "\n";
  return file;
}

// A run file for `objective` over those pieces; `extra` is appended (the objective's section,
// more keys).
inline std::string tiny_post_toml(const std::filesystem::path& run_dir,
                                  const std::filesystem::path& model_file,
                                  const std::filesystem::path& tokenizer, int steps,
                                  const std::string& extra) {
  return "[run]\ndir = \"" + run_dir.string() + "\"\nseed = 3\nthreads = 2\n\n[model]\nbase = \"" +
         model_file.string() + "\"\ntokenizer = \"" + tokenizer.string() +
         "\"\nchat_template = \"chatml\"\n\n[train]\nsteps = " + std::to_string(steps) +
         "\n\n[optimizer]\nlr = 3e-3\n\n[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n\n"
         "[checkpoint]\ninterval = 2\nkeep = 0\n\n[metrics]\nlog_interval = 1000\n\n" +
         extra;
}

// The loop over `config`, quiet and without signal handlers; preempted once `stop_after` steps
// have run (-1: never).
inline train::PostResult run_post(const train::PostConfig& config,
                                  const train::ObjectiveFactory& make_objective, bool resume,
                                  int64_t stop_after = -1) {
  train::PostOptions o;
  o.quiet = true;
  o.handle_signals = false;
  o.resume = resume;
  o.stop_after = stop_after;
  return train::run_post_training(config, o, make_objective);
}

}  // namespace pollen::test_support
