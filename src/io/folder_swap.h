#pragma once
// Putting a folder written in full under a temporary name in place of another, so that a crash
// leaves one of the two whole under the final name, never a mix of their files. Used by
// checkpoints and by HF exports.
#include <filesystem>
#include <string>
#include <vector>

namespace pollen::io {

// fsyncs a folder, so that the names made, renamed or removed in it last.
void sync_folder(const std::filesystem::path& dir);

// Moves `staged` (synced by the caller) to `target`, in the same parent folder, and syncs that
// parent. Where `target` exists, the two are swapped in one step (renameat2 RENAME_EXCHANGE)
// and the old one, then under the staged name, is removed; where the file system cannot swap,
// the old one is first moved aside to `.old-NAME.PID`.
void replace_folder(const std::filesystem::path& staged, const std::filesystem::path& target);

// What writers killed midway left in `parent`: the entries named PREFIX then PID (with `step`:
// PREFIX, a step number, '.' and PID), for each of `prefixes`, of this process (done with them
// by now) or of one that no longer runs; sorted.
std::vector<std::filesystem::path> find_abandoned(const std::filesystem::path& parent,
                                                  const std::vector<std::string>& prefixes,
                                                  bool step = false);
// Removes what find_abandoned finds and returns it.
std::vector<std::filesystem::path> remove_abandoned(const std::filesystem::path& parent,
                                                    const std::vector<std::string>& prefixes,
                                                    bool step = false);

}  // namespace pollen::io
