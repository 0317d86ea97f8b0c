#include "base/files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "base/error.h"

namespace pollen {
namespace {
std::string errno_text() {
  return std::strerror(errno);
}

void write_all(int fd, std::string_view data, const std::filesystem::path& path) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    POLLEN_CHECK(n > 0, "cannot write '", path.string(), "': ", errno_text());
    done += static_cast<size_t>(n);
  }
}

// What `produce` passes, written to `fd` in writes of about 1 MiB: a producer of many small
// pieces (a line of ids a document) makes few system calls. `name` is for errors.
void produce_into(int fd, const std::filesystem::path& name,
                  const std::function<void(const FileSink&)>& produce) {
  constexpr size_t kBlock = size_t{1} << 20;
  std::string block;
  produce([&](std::string_view piece) {
    if (block.size() + piece.size() > kBlock) {
      write_all(fd, block, name);
      block.clear();
    }
    if (piece.size() >= kBlock)
      write_all(fd, piece, name);
    else
      block.append(piece);
  });
  write_all(fd, block, name);
}
}  // namespace

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  POLLEN_CHECK(in, "cannot open '", path.string(), "' for reading: ", errno_text());
  std::ostringstream ss;
  ss << in.rdbuf();
  POLLEN_CHECK(!in.bad(), "error while reading '", path.string(), "'");
  return ss.str();
}

bool is_special_file(const std::filesystem::path& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

void check_writable(const std::string& path, const std::string& option) {
  namespace fs = std::filesystem;
  if (path.empty() || is_special_file(path)) return;
  const fs::path parent = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : ".";
  POLLEN_CHECK(!fs::is_directory(path), option, " '", path, "' is a folder; give a file name");
  POLLEN_CHECK(fs::is_directory(parent) && ::access(parent.c_str(), W_OK) == 0, option, " '", path,
               "': its folder '", parent.string(), "' does not exist or cannot be written");
}

namespace {

// Where a write to `path` lands, its links followed: a descriptor of this process (/dev/stdout,
// /dev/fd/3, /proc/self/fd/3), or the path that is no link (which may not exist yet).
struct Destination {
  std::optional<int> descriptor;
  std::filesystem::path path;
};

Destination destination(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const std::string own = cat("/proc/", ::getpid(), "/fd/");
  fs::path p = path;
  std::error_code ec;
  for (int hops = 0; hops < 40; ++hops) {
    const std::string s = fs::absolute(p, ec).lexically_normal().string();
    for (const std::string& prefix :
         {std::string("/proc/self/fd/"), std::string("/proc/thread-self/fd/"),
          std::string("/dev/fd/"), own}) {
      if (!s.starts_with(prefix)) continue;
      int fd = -1;
      const std::string_view digits = std::string_view(s).substr(prefix.size());
      const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), fd);
      if (error == std::errc() && end == digits.data() + digits.size()) return {fd, p};
    }
    // A link to a device, pipe or socket is opened through (another process's descriptor links
    // read as "pipe:[N]", no path).
    if (!fs::is_symlink(p, ec) || is_special_file(p)) return {std::nullopt, p};
    const fs::path target = fs::read_symlink(p, ec);
    POLLEN_CHECK(!ec, "cannot read the link '", p.string(), "': ", ec.message());
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  fail("cannot write '", path.string(), "': its links go round in a loop");
}

}  // namespace

void write_file_atomic(const std::filesystem::path& path, std::string_view data, int mode) {
  write_file_atomic_by(
      path, [&](const FileSink& write) { write(data); }, mode);
}

void remove_dead_writers_files(const std::filesystem::path& path) {
  const auto dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  const std::string prefix = cat(".", path.filename().string(), ".tmp.");
  std::error_code error;
  for (const auto& e : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(prefix) || name.size() == prefix.size()) continue;
    pid_t pid = 0;
    const char* end = name.data() + name.size();
    const auto [stop, failed] = std::from_chars(name.data() + prefix.size(), end, pid);
    if (failed != std::errc() || stop != end || pid <= 0) continue;
    if (::kill(pid, 0) != 0 && errno == ESRCH) std::filesystem::remove(e.path(), error);
  }
}

void write_file_atomic_by(const std::filesystem::path& requested,
                          const std::function<void(const FileSink&)>& produce, int mode) {
  // A descriptor of this process (--output /dev/stdout) is written where it stands, whatever it
  // is open on: opened again, a redirected file would be written from its start, and renamed
  // over, the link would become a file. A link to a file has that file replaced; the link stays.
  const Destination to = destination(requested);
  if (to.descriptor) {
    produce_into(*to.descriptor, requested, produce);
    return;
  }
  const std::filesystem::path& path = to.path;
  if (is_special_file(path)) {
    // A device, pipe or terminal (a FIFO, /dev/null) is written in place: a rename over it
    // would replace the node itself with a file.
    int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    POLLEN_CHECK(fd >= 0, "cannot open '", path.string(), "' for writing: ", errno_text());
    try {
      produce_into(fd, path, produce);
    } catch (...) {
      ::close(fd);
      throw;
    }
    POLLEN_CHECK(::close(fd) == 0, "cannot write '", path.string(), "': ", errno_text());
    return;
  }
  auto dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  auto tmp = dir / cat(".", path.filename().string(), ".tmp.", ::getpid());
  ::unlink(tmp.c_str());  // a leftover temp file of this pid would keep its old permissions
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, static_cast<mode_t>(mode));
  POLLEN_CHECK(fd >= 0, "cannot create '", tmp.string(), "': ", errno_text());
  try {
    produce_into(fd, tmp, produce);
    POLLEN_CHECK(::fsync(fd) == 0, "cannot sync '", tmp.string(), "': ", errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    fail("cannot rename '", tmp.string(), "' to '", path.string(), "': ", why);
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  POLLEN_CHECK(fd >= 0, "cannot open '", path.string(), "': ", errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("cannot stat '", path.string(), "': ", errno_text());
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    POLLEN_CHECK(p != MAP_FAILED, "cannot map '", path.string(), "': ", errno_text());
    data_ = static_cast<const std::byte*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace pollen
