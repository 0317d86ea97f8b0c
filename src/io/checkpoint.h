#pragma once
// Checkpoint directories that never lose a run. A checkpoint is a folder `step-00000100/`
// holding any files plus manifest.json (step, and the size and SHA-256 of every file). It is
// written into `.tmp-step-00000100.<pid>/`, every file and the folder fsynced, then renamed into
// place and the parent fsynced: a crash leaves either the whole checkpoint or a temp folder
// that nothing mistakes for one. Resuming takes the newest checkpoint that verifies. Files go
// through write_synced (direct I/O from reused blocks, hashed beside the writes), one after
// the other: writing them in parallel measured slower on a shared two-core machine.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"

namespace pollen::io {

std::string checkpoint_name(int64_t step);  // "step-00000100"

class CheckpointWriter {
 public:
  CheckpointWriter(const std::filesystem::path& root, int64_t step);
  ~CheckpointWriter();  // removes the temp folder unless commit() ran
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  void add_tensors(const std::string& file, const NamedTensors& tensors,
                   const std::map<std::string, std::string>& metadata = {});
  void add_text(const std::string& file, std::string_view text);
  // Writes the manifest, syncs and renames; returns the final folder.
  std::filesystem::path commit();

  const WriteStats& stats() const { return stats_; }  // all files together

 private:
  void record(const std::string& file, const WriteStats& s);

  std::filesystem::path tmp_, final_;
  int64_t step_;
  std::vector<std::pair<std::string, WriteStats>> files_;
  WriteStats stats_;
  bool committed_ = false;
};

// Checks the manifest and every file's size and SHA-256; returns why it fails, or nothing.
// `only`: when not empty, only these of the manifest's files are checked (the ones a reader
// loads: a folder whose optimizer state was removed still gives its model), and each of those
// that holds weights (.safetensors) and is in the folder must be in the manifest.
std::optional<std::string> verify_checkpoint(const std::filesystem::path& dir,
                                             const std::vector<std::string>& only = {});
// The step recorded in a checkpoint's manifest.
int64_t checkpoint_step(const std::filesystem::path& dir);

// Complete checkpoint folders under `root` (step-*), oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& root);

struct ResumeChoice {
  std::optional<std::filesystem::path> dir;                            // newest that verifies
  std::vector<std::pair<std::filesystem::path, std::string>> skipped;  // newer ones, and why
};
ResumeChoice choose_resume_checkpoint(const std::filesystem::path& root);

// For a run that resumes: the newest checkpoint under `root` that verifies (none: no dir), and
// how many newer ones were skipped, each with a warning that starts with `who`. When one is
// chosen, the newer ones that do not verify are moved aside (".corrupt-step-..."): the resumed
// run will never reach them again, and retention would otherwise count them as the newest and
// delete good checkpoints instead. A caller refuses to start when some were skipped and none
// verifies, rather than start afresh beside them.
struct ResumePoint {
  std::optional<std::filesystem::path> dir;
  int64_t skipped = 0;
};
ResumePoint choose_checkpoint_to_resume(const std::filesystem::path& root, const std::string& who);

// Deletes all but the newest `keep` checkpoints (keep <= 0 keeps all) and leftover temp
// folders of this process or of dead ones; returns what it removed.
std::vector<std::filesystem::path> apply_retention(const std::filesystem::path& root, int keep);

}  // namespace pollen::io
