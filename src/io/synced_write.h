#pragma once
// Writing a file that must reach the disk whole and fast (checkpoints, exported weights). The
// bytes come as pieces of memory in file order (a header, then each tensor). They are copied
// into a few aligned 16 MiB blocks, and each full block is written with O_DIRECT on its own
// thread while the next one is filled: the disk takes the bytes straight from the block, so the
// page cache is neither filled nor written back, and the copy stays in the CPU's cache instead
// of streaming through memory a second time. The last block is padded to the 4 KiB unit and
// the file cut back to its size. A file system without direct I/O gets the same blocks as
// buffered writes. SHA-256 runs on a second thread over the pieces, never re-reading the file.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pollen::io {

// Seconds spent in each phase. serialise_s: copying the pieces into the write blocks; sync_s:
// waiting for the disk to take earlier blocks, the final fsync and folder syncs; hash_s:
// SHA-256, on its own thread beside the other two, so the phases may add up to more than the
// wall time.
struct WriteStats {
  uint64_t bytes = 0;
  std::string sha256;
  double serialise_s = 0, hash_s = 0, sync_s = 0;
  WriteStats& operator+=(const WriteStats& o) {
    bytes += o.bytes;
    serialise_s += o.serialise_s;
    hash_s += o.hash_s;
    sync_s += o.sync_s;
    return *this;
  }
};

using ByteSpans = std::vector<std::span<const std::byte>>;

// Creates (or truncates) `path`, writes the pieces one after the other, fsyncs and closes it.
// The memory must stay unchanged until the call returns.
WriteStats write_synced(const std::filesystem::path& path, const ByteSpans& pieces);
WriteStats write_synced(const std::filesystem::path& path, std::string_view data);

}  // namespace pollen::io
