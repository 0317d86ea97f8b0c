// The data-readers fuzz target (tests/data/fuzz) on its corpus, so that every run of the suite
// exercises it: each input, read as a plain, delimited or JSONL file, as it is or compressed,
// must give exactly the documents and problems its content holds, and nothing else may happen.
// The corpus holds the seeds and every input the fuzzer found a fault with.
#include <gtest/gtest.h>

#include "data/fuzz/readers_target.h"
#include "support/fuzz_corpus.h"

using namespace pollen;

TEST(ReadersFuzz, CorpusIsReadAsItsContentHolds) {
  const auto run = pollen::testing::run_corpus(POLLEN_SOURCE_DIR "/tests/data/fuzz/corpus",
                                               fuzz::read_untrusted_input);
  EXPECT_GT(run.files, 1);
  EXPECT_GT(run.taken, 0);  // the seeds hold documents
}
