// libFuzzer target for the safetensors reader (built when the compiler has -fsanitize=fuzzer;
// see tests/CMakeLists.txt). Run: build/fuzz_safetensors tests/io/fuzz/corpus
#include "io/fuzz/safetensors_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pollen::fuzz::parse_untrusted_safetensors(data, size);
  return 0;
}
