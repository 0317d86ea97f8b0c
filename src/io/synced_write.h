#pragma once
// Writing a file that must reach the disk whole and fast (checkpoints, exported weights). The
// bytes come as pieces of memory in file order (a header, then each tensor) and go out in large
// gathered writes. Writeback of every chunk is started as soon as it is written
// (sync_file_range), so the disk works while later chunks are still being copied and the final
// fsync has little left; a bounded window of chunks may be in flight, so dirty memory stays
// small. SHA-256 runs on a second thread over the same memory, never re-reading the file.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pollen::io {

// Seconds spent in each phase, on whichever thread ran it. serialise_s: the write calls (copying
// into the page cache); hash_s: SHA-256, on its own thread beside the writes; sync_s: waiting
// for writeback of earlier chunks, the final fsync and folder syncs. The phases overlap, so
// they may add up to more than the wall time.
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
