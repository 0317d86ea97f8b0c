#include "io/folder_swap.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>

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

namespace {

// The process that wrote `name` when it is PREFIX then a pid (with a step: PREFIX, a number,
// '.' and a pid). Nothing for any other name, such as another output's "PREFIXv2.PID".
std::optional<pid_t> writer_of(const std::string& name, const std::string& prefix, bool step) {
  if (!name.starts_with(prefix)) return std::nullopt;
  std::string_view rest = std::string_view(name).substr(prefix.size());
  const auto digits = [](std::string_view s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
  };
  if (step) {
    const size_t dot = rest.find('.');
    if (dot == std::string_view::npos || !digits(rest.substr(0, dot))) return std::nullopt;
    rest = rest.substr(dot + 1);
  }
  if (!digits(rest)) return std::nullopt;
  return static_cast<pid_t>(std::atol(std::string(rest).c_str()));
}

}  // namespace

std::vector<fs::path> find_abandoned(const fs::path& parent,
                                     const std::vector<std::string>& prefixes, bool step) {
  std::vector<fs::path> found;
  if (!fs::is_directory(parent)) return found;
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string name = e.path().filename().string();
    for (const auto& prefix : prefixes) {
      const std::optional<pid_t> pid = writer_of(name, prefix, step);
      if (!pid) continue;
      // Another process that runs (kill succeeds, or it is another user's) is still writing.
      const bool other_writer =
          *pid > 0 && *pid != ::getpid() && (::kill(*pid, 0) == 0 || errno == EPERM);
      if (!other_writer) found.push_back(e.path());
      break;
    }
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::vector<fs::path> remove_abandoned(const fs::path& parent,
                                       const std::vector<std::string>& prefixes, bool step) {
  const std::vector<fs::path> found = find_abandoned(parent, prefixes, step);
  for (const auto& p : found) {
    std::error_code ignored;
    fs::remove_all(p, ignored);
  }
  return found;
}

}  // namespace pollen::io
