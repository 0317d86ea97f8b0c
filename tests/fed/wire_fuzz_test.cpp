// The federation wire fuzz target (tests/fed/fuzz) on its corpus and on freshly made valid
// messages, so that every run of the suite exercises it: each input must be taken or refused
// with pollen::Error; nothing else may happen. The corpus holds the seeds and every input the
// fuzzer found a fault with.
#include <gtest/gtest.h>

#include <string>

#include "fed/fuzz/wire_target.h"
#include "support/fuzz_corpus.h"

using namespace pollen;

namespace {

bool run_target(const std::string& input) {
  return fuzz::receive_untrusted_fed(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

}  // namespace

TEST(FedWireFuzz, CorpusIsTakenOrRefused) {
  const auto run = pollen::testing::run_corpus(POLLEN_SOURCE_DIR "/tests/fed/fuzz/corpus",
                                               fuzz::receive_untrusted_fed);
  EXPECT_GT(run.files, 10);
}

TEST(FedWireFuzz, ValidMessagesAreTaken) {
  const auto inputs = fuzz::fed_wire::valid_inputs();
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_TRUE(run_target(inputs[i])) << "input " << i;
}

// Found by the fuzzer (corpus/regression_none_empty_payload): an empty tensor in codec none was
// copied with memcpy from or to a null pointer, undefined even for 0 bytes.
TEST(FedWireFuzz, EmptyTensorsEncodeAndDecodeWithoutData) {
  fed::CompressOptions none;
  std::string out;
  fed::encode(nullptr, 0, none, out);
  EXPECT_TRUE(out.empty());
  EXPECT_NO_THROW(fed::decode(nullptr, 0, 0, none, nullptr, "empty"));
}
