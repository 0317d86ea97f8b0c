// The config fuzz target (tests/fed/fuzz/configs_target.h) on its corpus, so that every run of
// the suite exercises it: each training, post-training, federation or data preparation config
// must be read or refused with pollen::Error; nothing else may happen. The corpus holds the seeds
// (one valid config per reader) and every input the fuzzer found a fault with.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "base/files.h"
#include "fed/fuzz/configs_target.h"

using namespace pollen;

namespace {

bool run_target(const std::string& input) {
  return fuzz::read_untrusted_config(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

}  // namespace

TEST(ConfigsFuzz, CorpusIsReadOrRefused) {
  const std::filesystem::path dir = POLLEN_SOURCE_DIR "/tests/fed/fuzz/configs_corpus";
  int files = 0, read = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++files;
    try {
      read += run_target(read_file(entry.path()));
    } catch (const std::exception& e) {
      ADD_FAILURE() << entry.path().filename() << " escaped as " << e.what();
    }
  }
  EXPECT_GT(files, 1);
  EXPECT_GT(read, 0);
}

// Every seed is a valid config of its reader, so that the fuzzer starts from inputs that reach
// past the first missing table.
TEST(ConfigsFuzz, SeedsAreRead) {
  const std::filesystem::path dir = POLLEN_SOURCE_DIR "/tests/fed/fuzz/configs_corpus";
  for (const char* seed : {"train", "sft", "sft_lora", "dpo", "rm", "grpo", "fed_server",
                           "fed_client", "fed_client_post", "fed_sim", "data"})
    EXPECT_TRUE(run_target(read_file(dir / seed))) << seed;
}
