#pragma once
// Every rank of a job must run the same run file (and --set values) on the same data: a node
// with a stale copy of either would train another model than the others while the job reports
// one, or fail in a collective with an error that names neither.
#include <filesystem>
#include <string>
#include <vector>

#include "dist/communicator.h"

namespace pollen::dist {

// What a rank runs: its run file's text with the command's options that change it after it
// ("--set k=v", "--device cuda"), and the data files it reads (their contents count, not their
// paths: nodes may mount the data elsewhere).
struct RankInputs {
  std::filesystem::path run_file;
  std::vector<std::string> options;
  std::vector<std::filesystem::path> data_files;
};

// The text the ranks compare: the run file, each option, and each data file's SHA-256, in three
// parts.
std::string rank_inputs_text(const RankInputs& inputs);

// Where rank `rank`'s inputs text `mine` first differs from rank 0's `root`: the run file's line,
// the option, or the data file (this rank's path named); empty when they are the same.
std::string inputs_difference(const RankInputs& inputs, const std::string& root,
                              const std::string& mine, int rank);

// A collective: rank 0 sends its inputs' text to the others, and every rank fails (so that the
// job ends with exit 1 before its first step) when any differs, the rank that differs naming the
// first line that does.
void check_ranks_run_the_same(Communicator& comm, const RankInputs& inputs);

}  // namespace pollen::dist
