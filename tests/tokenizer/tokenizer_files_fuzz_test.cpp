// The tokenizer-files fuzz target (tests/tokenizer/fuzz) on its corpus, so that every run of the
// suite exercises it: each tokenizer.json or tiktoken rank file must be loaded or refused with
// pollen::Error; nothing else may happen. The corpus holds the seeds and every file the fuzzer
// found a fault with.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "base/files.h"
#include "tokenizer/fuzz/tokenizer_files_target.h"

using namespace pollen;

namespace {

bool run_target(const std::string& input) {
  return fuzz::load_untrusted_tokenizer(reinterpret_cast<const uint8_t*>(input.data()),
                                        input.size());
}

}  // namespace

TEST(TokenizerFilesFuzz, CorpusIsLoadedOrRefused) {
  const std::filesystem::path dir = POLLEN_SOURCE_DIR "/tests/tokenizer/fuzz/corpus";
  int files = 0, loaded = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++files;
    try {
      loaded += run_target(read_file(entry.path()));
    } catch (const std::exception& e) {
      ADD_FAILURE() << entry.path().filename() << " escaped as " << e.what();
    }
  }
  EXPECT_GT(files, 1);
  EXPECT_GT(loaded, 0);  // the seeds are valid files
}
