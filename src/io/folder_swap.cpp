#include "io/folder_swap.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/error.h"

namespace fs = std::filesystem;

namespace pollen::io {

void sync_folder(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  POLLEN_CHECK(fd >= 0, "cannot open folder '", dir.string(), "': ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  POLLEN_CHECK(rc == 0, "cannot sync folder '", dir.string(), "': ", std::strerror(errno));
}

void replace_folder(const fs::path& staged, const fs::path& target) {
  const fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  if (!fs::exists(fs::symlink_status(target))) {
    fs::rename(staged, target);
    sync_folder(parent);
    return;
  }
  if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    sync_folder(parent);
    fs::remove_all(staged);  // the old folder, now under the staged name
    return;
  }
  const fs::path old = parent / cat(".old-", target.filename().string(), ".", ::getpid());
  fs::remove_all(old);
  fs::rename(target, old);
  fs::rename(staged, target);
  sync_folder(parent);
  fs::remove_all(old);
}

std::vector<fs::path> remove_abandoned(const fs::path& parent,
                                       const std::vector<std::string>& prefixes) {
  std::vector<fs::path> removed;
  if (!fs::is_directory(parent)) return removed;
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string name = e.path().filename().string();
    if (std::none_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return name.starts_with(p); }))
      continue;
    const std::string digits = name.substr(name.rfind('.') + 1);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::atol(digits.c_str()));
    // Another process that runs (kill succeeds, or it is another user's) is still writing.
    const bool other_writer =
        pid > 0 && pid != ::getpid() && (::kill(pid, 0) == 0 || errno == EPERM);
    if (!other_writer) removed.push_back(e.path());
  }
  for (const auto& p : removed) {
    std::error_code ignored;
    fs::remove_all(p, ignored);
  }
  return removed;
}

}  // namespace pollen::io
