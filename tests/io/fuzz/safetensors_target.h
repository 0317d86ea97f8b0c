#pragma once
// What the safetensors fuzz target runs on each input: the parser must either read the bytes or
// refuse them with pollen::Error. Anything else (another exception, a crash, a sanitizer report)
// is a finding. Shared by the libFuzzer target and the deterministic corpus test.
#include <cstddef>
#include <cstdint>

#include "base/error.h"
#include "io/safetensors.h"

namespace pollen::fuzz {

// True when the input parsed, false when it was refused.
inline bool parse_untrusted_safetensors(const uint8_t* data, size_t size) {
  try {
    io::parse_safetensors(reinterpret_cast<const std::byte*>(data), size, "fuzz input");
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace pollen::fuzz
