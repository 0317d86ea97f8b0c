// The config fuzz target (tests/fed/fuzz/configs_target.h) on its corpus, so that every run of
// the suite exercises it: each training, post-training, federation or data preparation config
// must be read or refused with pollen::Error; nothing else may happen. The corpus holds the seeds
// (one valid config per reader) and every input the fuzzer found a fault with.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "base/files.h"
#include "fed/fuzz/configs_target.h"
#include "support/fuzz_corpus.h"

using namespace pollen;

namespace {

const std::filesystem::path kCorpus = POLLEN_SOURCE_DIR "/tests/fed/fuzz/configs_corpus";

bool run_target(const std::string& input) {
  return fuzz::read_untrusted_config(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

}  // namespace

TEST(ConfigsFuzz, CorpusIsReadOrRefused) {
  const auto run = pollen::testing::run_corpus(kCorpus, fuzz::read_untrusted_config);
  EXPECT_GT(run.files, 1);
  EXPECT_GT(run.taken, 0);
}

// Every seed is a valid config of its reader, so that the fuzzer starts from inputs that reach
// past the first missing table.
TEST(ConfigsFuzz, SeedsAreRead) {
  for (const char* seed :
       {"train", "sft", "sft_lora", "dpo", "rm", "grpo", "fed_server", "fed_server_privacy",
        "fed_client", "fed_client_post", "fed_sim", "data"})
    EXPECT_TRUE(run_target(read_file(kCorpus / seed))) << seed;
}
