#pragma once
// Files: whole-file reads, atomic writes (temp file, fsync, rename, fsync the folder) so that a
// crash never leaves a half-written file under the final name, and read-only memory maps.
#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace pollen {

std::string read_file(const std::filesystem::path& path);

// Whether `path` (its links followed) is a device, pipe, terminal or socket: something to write
// into in place, never to replace.
bool is_special_file(const std::filesystem::path& path);

// Refuses, before the work whose result it is to hold, an output path that could not be written
// once that work is done (a folder, a folder that does not exist or cannot be written), naming
// `option` (--output). A special file (/dev/stdout, a FIFO) passes: it is written in place.
void check_writable(const std::string& path, const std::string& option);

// Writes `data` to `path` atomically: readers see the old file or the whole new one.
// `mode`: the permissions the file is created with (before the umask), from its first byte.
// A special file (/dev/stdout, a FIFO) is written in place instead.
void write_file_atomic(const std::filesystem::path& path, std::string_view data, int mode = 0644);

// As write_file_atomic, with the bytes coming from `produce`, which passes each piece in file
// order to the sink it is given: a file larger than memory is written piece by piece. Nothing is
// left behind when `produce` throws.
using FileSink = std::function<void(std::string_view)>;
void write_file_atomic_by(const std::filesystem::path& path,
                          const std::function<void(const FileSink&)>& produce, int mode = 0644);

// Removes what killed writers of `path` left beside it: write_file_atomic's temporary files
// (.NAME.tmp.PID) of processes that no longer run. For large outputs, which a kill would
// otherwise leave behind whole.
void remove_dead_writers_files(const std::filesystem::path& path);

class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace pollen
