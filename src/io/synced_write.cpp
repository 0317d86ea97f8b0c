#include "io/synced_write.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <utility>

#include "base/error.h"
#include "base/hash.h"

namespace pollen::io {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr size_t kChunk = size_t{8} << 20;  // bytes per gathered write and writeback request
constexpr size_t kInFlight = 16;            // chunks written but not yet known to be on disk

// Walks the pieces in order, handing out up to `max` bytes at a time as iovecs.
class PieceCursor {
 public:
  explicit PieceCursor(const ByteSpans& pieces) : pieces_(pieces) {}
  bool done() const { return index_ == pieces_.size(); }
  std::vector<iovec> next(size_t max) const {
    std::vector<iovec> iov;
    size_t i = index_, off = offset_, taken = 0;
    for (; i < pieces_.size() && taken < max && iov.size() < IOV_MAX; ++i, off = 0) {
      const size_t n = std::min(pieces_[i].size() - off, max - taken);
      if (n == 0) continue;
      iov.push_back({const_cast<std::byte*>(pieces_[i].data() + off), n});
      taken += n;
    }
    return iov;
  }
  void advance(size_t n) {  // past n bytes, and past any pieces that end there
    while (index_ < pieces_.size()) {
      const size_t step = std::min(pieces_[index_].size() - offset_, n);
      offset_ += step;
      n -= step;
      if (offset_ < pieces_[index_].size()) break;
      ++index_;
      offset_ = 0;
    }
  }

 private:
  const ByteSpans& pieces_;
  size_t index_ = 0, offset_ = 0;
};

// Runs sync_file_range and says why it failed; EINVAL/ENOSYS/EOPNOTSUPP (file systems without
// it) are not errors: the final fsync still makes the file durable.
void sync_range(int fd, uint64_t offset, uint64_t size, unsigned flags,
                const std::filesystem::path& path) {
  if (::sync_file_range(fd, static_cast<off_t>(offset), static_cast<off_t>(size), flags) == 0)
    return;
  POLLEN_CHECK(errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP || errno == ESPIPE,
               "cannot write back '", path.string(), "': ", std::strerror(errno));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

WriteStats write_synced(const std::filesystem::path& path, const ByteSpans& pieces) {
  WriteStats s;
  // The hash reads the same memory as the writes, on its own thread; the future joins it even
  // when a write throws, so the memory is never read after this function returns.
  std::future<std::pair<std::string, double>> hashed = std::async(std::launch::async, [&pieces] {
    const auto t0 = Clock::now();
    Sha256 sha;
    for (const auto& p : pieces) sha.update(p.data(), p.size());
    return std::pair{sha.hex_digest(), since(t0)};
  });

  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  POLLEN_CHECK(fd.get() >= 0, "cannot create '", path.string(), "': ", std::strerror(errno));
  PieceCursor cursor(pieces);
  uint64_t written = 0, kicked = 0, settled = 0;
  while (!cursor.done()) {
    const std::vector<iovec> iov = cursor.next(kChunk);
    if (iov.empty()) break;  // only empty pieces remain
    auto t0 = Clock::now();
    const ssize_t n =
        ::pwritev(fd.get(), iov.data(), static_cast<int>(iov.size()), static_cast<off_t>(written));
    if (n < 0 && errno == EINTR) continue;
    POLLEN_CHECK(n > 0, "cannot write '", path.string(), "': ", std::strerror(errno));
    s.serialise_s += since(t0);
    cursor.advance(static_cast<size_t>(n));
    written += static_cast<uint64_t>(n);
    t0 = Clock::now();
    if (written - kicked >= kChunk) {  // start writing back what was just copied
      sync_range(fd.get(), kicked, written - kicked, SYNC_FILE_RANGE_WRITE, path);
      kicked = written;
    }
    if (kicked - settled > kChunk * kInFlight) {  // wait for the oldest chunk to reach the disk
      sync_range(fd.get(), settled, kChunk,
                 SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER,
                 path);
      settled += kChunk;
    }
    s.sync_s += since(t0);
  }
  const auto t0 = Clock::now();
  POLLEN_CHECK(::fsync(fd.get()) == 0, "cannot sync '", path.string(), "': ", std::strerror(errno));
  POLLEN_CHECK(::close(fd.release()) == 0, "cannot close '", path.string(),
               "': ", std::strerror(errno));
  s.sync_s += since(t0);
  s.bytes = written;
  auto [sha, hash_s] = hashed.get();
  s.sha256 = std::move(sha);
  s.hash_s = hash_s;
  return s;
}

WriteStats write_synced(const std::filesystem::path& path, std::string_view data) {
  return write_synced(path, ByteSpans{std::as_bytes(std::span(data))});
}

}  // namespace pollen::io
