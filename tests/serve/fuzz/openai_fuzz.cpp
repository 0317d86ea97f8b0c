// libFuzzer target for the OpenAI-compatible server's request bodies (built when the compiler has
// -fsanitize=fuzzer; see tests/CMakeLists.txt). Run: build-fuzz/tests/fuzz_serve_openai
// -dict=tests/serve/fuzz/openai.dict tests/serve/fuzz/corpus
#include "serve/fuzz/openai_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pollen::fuzz::handle_untrusted_request(data, size);
  return 0;
}
