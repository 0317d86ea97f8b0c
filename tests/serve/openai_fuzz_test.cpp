// The OpenAI request fuzz target (tests/serve/fuzz) on its corpus, so that every run of the suite
// exercises it: each body must be taken or refused with pollen::Error; nothing else may happen.
// The corpus holds the seeds and every body the fuzzer found a fault with.
#include <gtest/gtest.h>

#include "serve/fuzz/openai_target.h"
#include "support/fuzz_corpus.h"

using namespace pollen;

TEST(OpenAiFuzz, CorpusIsTakenOrRefused) {
  const auto run = pollen::testing::run_corpus(POLLEN_SOURCE_DIR "/tests/serve/fuzz/corpus",
                                               fuzz::handle_untrusted_request);
  EXPECT_GT(run.files, 3);
  EXPECT_GT(run.taken, 0);  // the seeds are valid requests
}
