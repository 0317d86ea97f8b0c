#pragma once
// A fuzz target run over every file of its committed corpus, so that the normal test suite (no
// libFuzzer needed) checks the seeds and every input a fuzzer once found a fault with: each must
// be taken or refused with pollen::Error; any other exception fails the test naming the file.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <string>

#include "base/files.h"

namespace pollen::testing {

struct CorpusRun {
  int files = 0;
  int taken = 0;  // inputs the target took (the rest it refused)
};

// target: bool(const uint8_t* data, size_t size), true when it took the input.
template <typename Target>
CorpusRun run_corpus(const std::filesystem::path& dir, Target target) {
  CorpusRun run;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++run.files;
    const std::string input = read_file(entry.path());
    try {
      run.taken += target(reinterpret_cast<const uint8_t*>(input.data()), input.size());
    } catch (const std::exception& e) {
      ADD_FAILURE() << entry.path().filename() << " escaped as " << e.what();
    }
  }
  return run;
}

}  // namespace pollen::testing
