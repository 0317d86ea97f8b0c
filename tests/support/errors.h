#pragma once
// The message of what a call throws, for tests that check what an error says.
#include <exception>
#include <string>

namespace pollen::testing {

// The message of the exception `f` throws; "" when it throws nothing.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace pollen::testing
