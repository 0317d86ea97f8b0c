// libFuzzer target for the TOML configs users and operators write: training and post-training
// run files, the federation's server, client and simulation configs and the data preparation
// config (built when the compiler has -fsanitize=fuzzer; see tests/CMakeLists.txt). Run:
// build-fuzz/tests/fuzz_configs tests/fed/fuzz/configs_corpus
#include "fed/fuzz/configs_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pollen::fuzz::read_untrusted_config(data, size);
  return 0;
}
