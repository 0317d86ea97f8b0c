#include "io/synced_write.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <utility>

#include "base/error.h"
#include "base/hash.h"

namespace pollen::io {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr size_t kAlign = 4096;              // O_DIRECT's unit for addresses, offsets, sizes
constexpr size_t kBlock = size_t{16} << 20;  // bytes per write
constexpr size_t kBlocks = 3;                // one being filled while the others are written

size_t round_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
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

// Opens for direct I/O where the file system has it, for buffered writes where it does not.
int open_for_writing(const std::filesystem::path& path) {
  constexpr int kFlags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  int fd = ::open(path.c_str(), kFlags | O_DIRECT, 0644);
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), kFlags, 0644);
  POLLEN_CHECK(fd >= 0, "cannot create '", path.string(), "': ", std::strerror(errno));
  return fd;
}

// Writes `size` bytes (a multiple of kAlign) at `offset`. A file system that refuses direct
// I/O at its first write (EINVAL: it needs a larger alignment, or has none) gets buffered
// writes instead; the final fsync makes either durable.
void write_block(int fd, const std::byte* data, size_t size, uint64_t offset,
                 const std::filesystem::path& path) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL && (::fcntl(fd, F_GETFL) & O_DIRECT)) {
      POLLEN_CHECK(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_DIRECT) == 0, "cannot write '",
                   path.string(), "': ", std::strerror(errno));
      continue;
    }
    POLLEN_CHECK(n >= 0, "cannot write '", path.string(), "' at byte ", offset + done, ": ",
                 std::strerror(errno));
    POLLEN_CHECK(n > 0, "cannot write '", path.string(), "' at byte ", offset + done,
                 ": the disk took no more bytes (is it full?)");
    done += static_cast<size_t>(n);
  }
}

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<std::byte, FreeDeleter>;

}  // namespace

WriteStats write_synced(const std::filesystem::path& path, const ByteSpans& pieces) {
  WriteStats s;
  for (const auto& p : pieces) s.bytes += p.size();
  // The hash reads the pieces on its own thread; the future joins it even when a write throws,
  // so the memory is never read after this function returns.
  std::future<std::pair<std::string, double>> hashed = std::async(std::launch::async, [&pieces] {
    const auto t0 = Clock::now();
    Sha256 sha;
    for (const auto& p : pieces) sha.update(p.data(), p.size());
    return std::pair{sha.hex_digest(), since(t0)};
  });

  Fd fd(open_for_writing(path));
  const size_t block = std::min(kBlock, round_up(s.bytes));
  std::vector<AlignedBytes> buffers;
  for (size_t i = 0; i < kBlocks && block > 0; ++i) {
    buffers.emplace_back(static_cast<std::byte*>(std::aligned_alloc(kAlign, block)));
    POLLEN_CHECK(buffers.back() != nullptr, "out of memory for the write buffers of '",
                 path.string(), "'");
  }
  // Destroyed first: waits for the writes still reading the buffers, even when one threw.
  std::vector<std::future<void>> writes(buffers.size());
  size_t piece = 0, piece_offset = 0;
  for (uint64_t offset = 0, index = 0; offset < s.bytes; offset += block, ++index) {
    std::future<void>& slot = writes[index % writes.size()];
    auto t0 = Clock::now();
    if (slot.valid()) slot.get();  // the disk is done with this buffer
    s.sync_s += since(t0);
    t0 = Clock::now();
    std::byte* buf = buffers[index % buffers.size()].get();
    size_t filled = 0;
    const size_t want = static_cast<size_t>(std::min<uint64_t>(block, s.bytes - offset));
    while (filled < want) {
      const auto& p = pieces[piece];
      const size_t n = std::min(p.size() - piece_offset, want - filled);
      std::memcpy(buf + filled, p.data() + piece_offset, n);
      filled += n;
      piece_offset += n;
      if (piece_offset == p.size()) ++piece, piece_offset = 0;
    }
    std::memset(buf + filled, 0, round_up(filled) - filled);  // cut off again by ftruncate
    s.serialise_s += since(t0);
    slot = std::async(std::launch::async, write_block, fd.get(), buf, round_up(filled), offset,
                      std::cref(path));
  }
  const auto t0 = Clock::now();
  for (auto& w : writes)
    if (w.valid()) w.get();
  POLLEN_CHECK(::ftruncate(fd.get(), static_cast<off_t>(s.bytes)) == 0, "cannot size '",
               path.string(), "': ", std::strerror(errno));
  POLLEN_CHECK(::fsync(fd.get()) == 0, "cannot sync '", path.string(), "': ", std::strerror(errno));
  POLLEN_CHECK(::close(fd.release()) == 0, "cannot close '", path.string(),
               "': ", std::strerror(errno));
  s.sync_s += since(t0);
  auto [sha, hash_s] = hashed.get();
  s.sha256 = std::move(sha);
  s.hash_s = hash_s;
  return s;
}

WriteStats write_synced(const std::filesystem::path& path, std::string_view data) {
  return write_synced(path, ByteSpans{std::as_bytes(std::span(data))});
}

}  // namespace pollen::io
