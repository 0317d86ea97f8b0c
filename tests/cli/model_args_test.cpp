// What the commands that take --model read beside it: lm-evaluation-harness's prefix token.
#include "cli/model_args.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "base/files.h"
#include "tokenizer/trainer.h"

namespace pollen::cli {
namespace {

namespace fs = std::filesystem;

// A byte-level BPE with two special tokens, <|endoftext|> (id below) and <|im_end|>.
tokenizer::Tokenizer two_specials() {
  tokenizer::PieceCounts counts(tokenizer::pattern_regex("gpt2"));
  const std::vector<std::string> texts = {"the cat sat on the mat", "a dog ran in the park"};
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  counts.add_documents(views);
  return tokenizer::train_bpe(counts, {300, {"<|endoftext|>", "<|im_end|>"}, counts.pattern()});
}

uint32_t id_of(const tokenizer::Tokenizer& tok, const std::string& content) {
  for (const auto& t : tok.added_tokens())
    if (t.content == content) return t.id;
  ADD_FAILURE() << content;
  return 0;
}

// lm-eval conditions on tokenizer.bos_token_id, else eos_token_id, as tokenizer_config.json
// names them (Qwen2.5-Instruct: no BOS, EOS <|im_end|>); a model without that file falls back
// to the first end token.
TEST(ModelArgs, PrefixTokenIsTheConfiguredBosElseEos) {
  const fs::path dir =
      fs::temp_directory_path() / ("pollen_model_args_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const tokenizer::Tokenizer tok = two_specials();
  const uint32_t end_of_text = id_of(tok, "<|endoftext|>"), im_end = id_of(tok, "<|im_end|>");
  ASSERT_LT(end_of_text, im_end);
  io::ModelSource src;
  EXPECT_EQ(lm_eval_prefix_token(src, tok), end_of_text);  // no tokenizer_config.json
  src.hf_side_files = {dir / "tokenizer_config.json"};
  write_file_atomic(dir / "tokenizer_config.json",
                    R"({"bos_token": null, "eos_token": "<|im_end|>"})");
  EXPECT_EQ(lm_eval_prefix_token(src, tok), im_end);
  write_file_atomic(dir / "tokenizer_config.json",
                    R"({"bos_token": {"content": "<|im_end|>"}, "eos_token": "<|endoftext|>"})");
  EXPECT_EQ(lm_eval_prefix_token(src, tok), im_end);
  // A file that is not JSON is an error naming it, not a file without the keys (export would
  // otherwise write another EOS and copy the broken file beside it).
  write_file_atomic(dir / "tokenizer_config.json", R"({"eos_token": "<|im_end|>",)");
  try {
    special_ids(src, tok);
    ADD_FAILURE() << "a truncated tokenizer_config.json was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json': not valid JSON"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// A checkpoint trained with a chat template ends its replies with the template's end of turn:
// that is its EOS (unless tokenizer_config.json names one), and every end token follows it.
TEST(ModelArgs, AChatTrainedModelsEosIsItsEndOfTurn) {
  const tokenizer::Tokenizer tok = two_specials();
  const uint32_t end_of_text = id_of(tok, "<|endoftext|>"), im_end = id_of(tok, "<|im_end|>");
  io::ModelSource src;
  EXPECT_EQ(special_ids(src, tok).eos, end_of_text);
  src.chat_template = "chatml";
  const SpecialIds ids = special_ids(src, tok);
  EXPECT_EQ(ids.eos, im_end);
  EXPECT_EQ(ids.ends, (std::vector<uint32_t>{im_end, end_of_text}));
  // lm-evaluation-harness's prefix token (no BOS here) is that EOS too, as serve reports it.
  EXPECT_EQ(lm_eval_prefix_token(src, tok), im_end);
  // A template whose end of turn the tokenizer lacks (another --tokenizer): the first end token.
  src.chat_template = "llama3";
  EXPECT_EQ(special_ids(src, tok).eos, end_of_text);
}

}  // namespace
}  // namespace pollen::cli
