// libFuzzer target for tokenizer files: HF tokenizer.json and tiktoken rank files (built when the
// compiler has -fsanitize=fuzzer; see tests/CMakeLists.txt). Run:
// build-fuzz/tests/fuzz_tokenizer_files tests/tokenizer/fuzz/corpus
#include "tokenizer/fuzz/tokenizer_files_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pollen::fuzz::load_untrusted_tokenizer(data, size);
  return 0;
}
