// The tokenizer-files fuzz target (tests/tokenizer/fuzz) on its corpus, so that every run of the
// suite exercises it: each tokenizer.json or tiktoken rank file must be loaded or refused with
// pollen::Error; nothing else may happen. The corpus holds the seeds and every file the fuzzer
// found a fault with.
#include <gtest/gtest.h>

#include "support/fuzz_corpus.h"
#include "tokenizer/fuzz/tokenizer_files_target.h"

using namespace pollen;

TEST(TokenizerFilesFuzz, CorpusIsLoadedOrRefused) {
  const auto run = pollen::testing::run_corpus(POLLEN_SOURCE_DIR "/tests/tokenizer/fuzz/corpus",
                                               fuzz::load_untrusted_tokenizer);
  EXPECT_GT(run.files, 1);
  EXPECT_GT(run.taken, 0);  // the seeds are valid files
}
