#include "dist/same_inputs.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>
#include <utility>

#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"

namespace pollen::dist {

namespace {

// Between the parts of a rank's inputs (a character no run file, option or hash line holds).
constexpr char kPartSeparator[] = "\x1e\n";

// The part's text up to the next separator, from `at` (moved past it).
std::string next_part(const std::string& text, size_t& at) {
  const size_t end = std::min(text.find(kPartSeparator, at), text.size());
  std::string part = text.substr(at, end - at);
  at = end == text.size() ? end : end + sizeof(kPartSeparator) - 1;
  return part;
}

// The first line where `mine` differs from `root`: its number, and "rank 0 has '...', rank R has
// '...'".
std::optional<std::pair<int, std::string>> differing_line(const std::string& root,
                                                          const std::string& mine, int rank) {
  if (root == mine) return std::nullopt;
  std::istringstream a(root), b(mine);
  std::string x, y;
  for (int line = 1;; ++line) {
    const bool more_a = static_cast<bool>(std::getline(a, x));
    const bool more_b = static_cast<bool>(std::getline(b, y));
    if (!more_a && !more_b)
      return std::pair{line, std::string("the texts differ in their line ends")};
    if (more_a && more_b && x == y) continue;
    const auto shown = [](bool more, const std::string& s) {
      return more ? cat("'", s.substr(0, 200), "'") : std::string("nothing");
    };
    return std::pair{
        line, cat("rank 0 has ", shown(more_a, x), ", rank ", rank, " has ", shown(more_b, y))};
  }
}

}  // namespace

std::string rank_inputs_text(const RankInputs& inputs) {
  std::string text = read_file(inputs.run_file);
  if (!text.empty() && text.back() != '\n') text += '\n';
  text += kPartSeparator;
  for (const std::string& option : inputs.options) text += option + "\n";
  text += kPartSeparator;
  for (size_t i = 0; i < inputs.data_files.size(); ++i)
    text += cat("data file ", i + 1, " of ", inputs.data_files.size(), ", SHA-256 ",
                sha256_file(inputs.data_files[i]), "\n");
  return text;
}

std::string inputs_difference(const RankInputs& inputs, const std::string& root,
                              const std::string& mine, int rank) {
  size_t at_root = 0, at_mine = 0;
  for (const std::string part : {"run file", "options", "data"}) {
    const auto d = differing_line(next_part(root, at_root), next_part(mine, at_mine), rank);
    if (!d) continue;
    const auto [line, lines] = *d;
    if (part == "run file") return cat(inputs.run_file.string(), ", line ", line, ": ", lines);
    if (part == "options") return cat("the command's options: ", lines);
    // A data line's number is its file's: this rank's copy is named (nodes may mount the data
    // elsewhere, so paths are not compared).
    const auto file = static_cast<size_t>(line);
    return cat("the data: ", lines,
               file <= inputs.data_files.size()
                   ? cat(" (this rank's copy: '", inputs.data_files[file - 1].string(), "')")
                   : std::string());
  }
  return {};
}

namespace {

// Rank 0's `text`, sent to every rank as 8 bytes per value.
std::string broadcast_text(Communicator& comm, const std::string& text) {
  int64_t size[1] = {static_cast<int64_t>(text.size())};
  comm.broadcast(size, 0, "the size of rank 0's run file and data");
  std::vector<int64_t> packed(static_cast<size_t>((size[0] + 7) / 8), 0);
  if (comm.rank() == 0) std::memcpy(packed.data(), text.data(), text.size());
  comm.broadcast(packed, 0, "rank 0's run file and data");
  std::string out(static_cast<size_t>(size[0]), '\0');
  std::memcpy(out.data(), packed.data(), out.size());
  return out;
}

}  // namespace

void check_ranks_run_the_same(Communicator& comm, const RankInputs& inputs) {
  if (comm.world() == 1) return;
  const std::string mine = rank_inputs_text(inputs);
  const std::string difference =
      inputs_difference(inputs, broadcast_text(comm, mine), mine, comm.rank());
  std::vector<double> differs(static_cast<size_t>(comm.world()), 0.0);
  differs[static_cast<size_t>(comm.rank())] = difference.empty() ? 0.0 : 1.0;
  comm.all_reduce_sum(differs, "whether the ranks run the same run file and data");
  std::string ranks;
  for (int r = 0; r < comm.world(); ++r)
    if (differs[static_cast<size_t>(r)] != 0) ranks += cat(ranks.empty() ? "" : ", ", r);
  if (ranks.empty()) return;
  POLLEN_CHECK(difference.empty(), "rank ", comm.rank(), " runs another run file, options or ",
               "data than rank 0 (", difference,
               "): every rank must run the same (a stale copy on one node?)");
  fail("rank(s) ", ranks, " run another run file, options or data than rank 0 (each names ",
       "what differs); every rank must run the same");
}

}  // namespace pollen::dist
