// The OpenAI request fuzz target (tests/serve/fuzz) on its corpus, so that every run of the suite
// exercises it: each body must be taken or refused with pollen::Error; nothing else may happen.
// The corpus holds the seeds and every body the fuzzer found a fault with.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "base/files.h"
#include "serve/fuzz/openai_target.h"

using namespace pollen;

namespace {

bool run_target(const std::string& input) {
  return fuzz::handle_untrusted_request(reinterpret_cast<const uint8_t*>(input.data()),
                                        input.size());
}

}  // namespace

TEST(OpenAiFuzz, CorpusIsTakenOrRefused) {
  const std::filesystem::path dir = POLLEN_SOURCE_DIR "/tests/serve/fuzz/corpus";
  int files = 0, taken = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++files;
    try {
      taken += run_target(read_file(entry.path()));
    } catch (const std::exception& e) {
      ADD_FAILURE() << entry.path().filename() << " escaped as " << e.what();
    }
  }
  EXPECT_GT(files, 3);
  EXPECT_GT(taken, 0);  // the seeds are valid requests
}
