#include "io/folder_swap.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
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

}  // namespace pollen::io
