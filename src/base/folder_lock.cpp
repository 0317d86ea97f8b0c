#include "base/folder_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "base/error.h"
#include "base/log.h"

namespace pollen {
namespace {

// What the holder wrote in the lock file: "host pid", or "" when it cannot be read.
std::string holder_of(int fd) {
  char buf[256] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

FolderLock::FolderLock(const std::filesystem::path& dir, std::string_view what,
                       const std::filesystem::path& lock_file) {
  const std::filesystem::path path = lock_file.empty() ? dir / ".lock" : lock_file;
  std::filesystem::create_directories(path.parent_path());
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  POLLEN_CHECK(fd_ >= 0, "cannot open '", path.string(), "': ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = holder_of(fd_);
    ::close(fd_);
    fd_ = -1;
    POLLEN_CHECK(err != EWOULDBLOCK, what, " '", dir.string(), "' is in use by another process",
                 holder.empty() ? std::string() : cat(" (host and process id: ", holder, ")"),
                 "; wait for it to end, or choose another ", what);
    // A filesystem without flock (Lustre mounted noflock, some NFS setups): the job goes on,
    // unguarded against a second process, and says so.
    POLLEN_CHECK(err == ENOSYS || err == EOPNOTSUPP || err == ENOLCK, "cannot lock '",
                 path.string(), "': ", std::strerror(err));
    log::warn("cannot lock '", path.string(), "' (", std::strerror(err),
              "): the filesystem takes no locks, so nothing stops a second process from "
              "working in ",
              what, " '", dir.string(), "' beside this one");
    return;
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string me = cat(host, " ", ::getpid(), "\n");
  // Who holds it, for the message a second process gets; the lock itself does not depend on it.
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] const ssize_t n = ::pwrite(fd_, me.data(), me.size(), 0);
  }
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace pollen
