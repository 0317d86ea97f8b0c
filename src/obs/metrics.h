#pragma once
// Metrics sinks: JSON lines (one object per line, what scripts and `pollen plot` read) and
// TensorBoard event files (TFRecord framing with masked CRC32C around hand-encoded Event
// protobufs holding scalar and text summaries). Both can be reopened at a byte position saved in a
// checkpoint, so a resumed run continues the same files without duplicate or lost points.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace pollen::obs {

// CRC-32C (Castagnoli), as TFRecord uses it; `crc` continues a previous value.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
// TFRecord's masking: rotate right by 15 and add 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size);

// One TFRecord: uint64 length, masked CRC of the length, data, masked CRC of the data.
std::string tfrecord(std::string_view data);
// An Event protobuf: wall_time, step and one scalar summary value (tag, simple_value).
std::string scalar_event(double wall_time, int64_t step, std::string_view tag, float value);
// An Event holding one text summary (TensorBoard's text plugin; shown under its TEXT tab).
std::string text_event(double wall_time, int64_t step, std::string_view tag, std::string_view text);
// The Event that opens every event file: file_version "brain.Event:2".
std::string file_version_event(double wall_time);
// A SessionLog START at `step`: TensorBoard drops the points it holds from `step` on when it
// reads one after the first (a restart).
std::string session_start_event(double wall_time, int64_t step);

// Seconds since the Unix epoch, as TensorBoard's wall_time.
double wall_time_now();

// What reopening at a saved position does with a file that is missing or shorter than that: refuse
// (an audit record, whose loss must not pass unnoticed), or warn and go on from its last whole
// line (JSONL) or record (TFRecord), so that nothing new is glued to a cut one (metrics: a run
// must not be kept from resuming for want of its curves).
enum class Shortfall { refuse, keep_whole_lines, keep_whole_records };

// An append-only file that can be reopened at a saved byte position (the tail after it is cut).
class AppendFile {
 public:
  AppendFile() = default;
  // Opens `path` for appending; when `resume_at` is given the file is first cut to that size.
  AppendFile(const std::filesystem::path& path, std::optional<uint64_t> resume_at = {},
             Shortfall shortfall = Shortfall::refuse);
  ~AppendFile();
  AppendFile(AppendFile&&) noexcept;
  AppendFile& operator=(AppendFile&&) noexcept;

  // One system call for all of `bytes` (the file is unbuffered).
  void write(std::string_view bytes);
  void flush();  // to the OS (a no-op kept for callers: writes are not buffered)
  void sync();   // flush and fsync: the position survives a crash
  uint64_t position() const { return position_; }
  const std::filesystem::path& path() const { return path_; }
  bool is_open() const { return file_ != nullptr; }

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  uint64_t position_ = 0;
};

class JsonlWriter {
 public:
  JsonlWriter() = default;
  JsonlWriter(const std::filesystem::path& path, std::optional<uint64_t> resume_at = {},
              Shortfall shortfall = Shortfall::refuse)
      : file_(path, resume_at, shortfall) {}
  // Invalid UTF-8 in strings (a sample cut inside a character) becomes U+FFFD, never an error.
  // Each record goes to the OS whole, at once (AppendFile::write): a crash between records leaves
  // whole lines.
  void write(const nlohmann::ordered_json& record) {
    file_.write(record.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) +
                "\n");
  }
  AppendFile& file() { return file_; }

 private:
  AppendFile file_;
};

class EventFileWriter {
 public:
  EventFileWriter() = default;
  // A new file events.out.tfevents.<time>.<host>.<pid> in `dir`; a run's starts with a session
  // start at `session_start`, its first step. (A file of evaluations beside a run's has none:
  // read after the run's, it would restart the run's curves.)
  static EventFileWriter create(const std::filesystem::path& dir,
                                std::optional<int64_t> session_start);
  // A resumed run: cuts the file it wrote to back to the checkpoint's position (one already
  // shorter keeps its whole records, warning) and goes on in a new file beside it that starts
  // with a session restart at `restart_step`, the first step the resumed run logs. A TensorBoard
  // watching the run then drops the points the interrupted run logged after the checkpoint,
  // which it had read before the cut and would otherwise keep showing.
  static EventFileWriter resume(const std::filesystem::path& path, uint64_t position,
                                int64_t restart_step);

  // Invalid UTF-8 in tags and text becomes U+FFFD.
  void add_scalar(std::string_view tag, double value, int64_t step, double wall_time);
  void add_text(std::string_view tag, std::string_view text, int64_t step, double wall_time);
  AppendFile& file() { return file_; }
  // Closes the file and removes it when nothing was written past what create wrote (a resumed
  // run that had nothing left to do leaves no file of its own).
  void discard_if_unused();

 private:
  AppendFile file_;
  uint64_t header_bytes_ = 0;  // what create wrote
};

}  // namespace pollen::obs
