// libFuzzer target for the data readers: plain, delimited and JSONL files, as they are or gzip
// or zstd compressed, read with small limits, and each JSONL record decoded (built when the
// compiler has -fsanitize=fuzzer; see tests/CMakeLists.txt). Run:
// build-fuzz/tests/fuzz_data_readers NEW_INPUTS_FOLDER tests/data/fuzz/corpus
#include "data/fuzz/readers_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pollen::fuzz::read_untrusted_input(data, size);
  return 0;
}
