#pragma once
// Errors: one exception type that carries a message naming what was wrong and where.
#include <sstream>
#include <stdexcept>
#include <string>

namespace pollen {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Concatenates anything streamable: cat("key '", k, "': expected ", n).
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(cat(args...));
}

}  // namespace pollen

// Checks a condition that depends on input; throws pollen::Error with the message otherwise.
#define POLLEN_CHECK(cond, ...)    \
  do {                             \
    if (!(cond)) [[unlikely]]      \
      ::pollen::fail(__VA_ARGS__); \
  } while (0)

// Checks an internal invariant; a failure is a bug in pollen, reported with file and line.
#define POLLEN_ASSERT(cond)                                                                \
  do {                                                                                     \
    if (!(cond)) [[unlikely]]                                                              \
      ::pollen::fail("internal error: ", #cond, " is false at ", __FILE__, ":", __LINE__); \
  } while (0)
