#pragma once
// Running a command from a test.
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace pollen::testing {

// Runs `cmd` in a shell; returns what it wrote to stdout, and to stderr too when `with_stderr`.
// *status gets its exit status (128 + the signal's number when a signal ended it).
inline std::string run_capture(const std::string& cmd, int* status, bool with_stderr = true) {
  std::string out;
  FILE* p = popen((with_stderr ? cmd + " 2>&1" : cmd).c_str(), "r");
  if (p == nullptr) {
    *status = -1;
    return out;
  }
  char buf[65536];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int raw = pclose(p);
  *status = WIFEXITED(raw) ? WEXITSTATUS(raw) : WIFSIGNALED(raw) ? 128 + WTERMSIG(raw) : -1;
  return out;
}

}  // namespace pollen::testing
