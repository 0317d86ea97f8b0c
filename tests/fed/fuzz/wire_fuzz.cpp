// libFuzzer target for what the federation receives from a peer: update pushes, model pulls,
// joins and compressed payloads (built when the compiler has -fsanitize=fuzzer; see
// tests/CMakeLists.txt). Run: build-fuzz/tests/fuzz_fed_wire tests/fed/fuzz/corpus
#include "fed/fuzz/wire_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pollen::fuzz::receive_untrusted_fed(data, size);
  return 0;
}
