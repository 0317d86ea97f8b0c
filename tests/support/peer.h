#pragma once
// Runs a Python reference script of tests/ in the peers environment (scripts/test-peers) on a
// JSON input and returns its JSON output.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "base/files.h"
#include "support/process.h"

namespace pollen::peer {

// Empty when the peers environment has `module`, else why not.
inline std::string missing(const std::string& module) {
  const std::string python = POLLEN_PEERS_PYTHON;
  if (!std::filesystem::exists(python))
    return "no peers venv at " + python + " (scripts/test-peers)";
  int status = 0;
  pollen::testing::run_capture(python + " -c 'import " + module + "'", &status);
  return status == 0 ? "" : module + " is not installed in the peers venv (scripts/test-peers)";
}

// tests/<script> ("fed/flower_reference.py") on `input`; fails the test (and returns null) when the
// script fails.
inline nlohmann::json run(const std::string& script, const nlohmann::json& input,
                          const std::string& tag) {
  const auto in = std::filesystem::temp_directory_path() /
                  ("pollen_peer_" + tag + "_" + std::to_string(::getpid()) + ".json");
  write_file_atomic(in, input.dump());
  int status = 0;
  const std::string out =
      pollen::testing::run_capture(std::string(POLLEN_PEERS_PYTHON) + " " + POLLEN_SOURCE_DIR +
                                       "/tests/" + script + " " + in.string(),
                                   &status, /*with_stderr=*/false);
  std::filesystem::remove(in);
  EXPECT_EQ(status, 0) << script << ": " << out;
  if (status != 0) return nullptr;
  return nlohmann::json::parse(out);
}

}  // namespace pollen::peer
