#pragma once
// One process at a time in a folder that a long job writes (a training run, a federated server's
// run): a second process on it is refused, naming the host and process that hold it, rather than
// both appending to its metrics and rotating its checkpoints. The lock is flock(2) on
// FOLDER/.lock, so it goes with the process however the process ends; the file stays.
#include <filesystem>
#include <string_view>

namespace pollen {

class FolderLock {
 public:
  // Creates `dir` if needed and takes its lock; throws naming `what` (e.g. "run.dir") and the
  // holder when another process has it. `lock_file`: where the lock is, when not dir/.lock
  // (a folder whose own files must not change from run to run keeps it in a subfolder).
  FolderLock(const std::filesystem::path& dir, std::string_view what,
             const std::filesystem::path& lock_file = {});
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace pollen
