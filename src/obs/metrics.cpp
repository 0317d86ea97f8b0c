#include "obs/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"
#include "base/utf8.h"

namespace pollen::obs {
namespace {

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void put_le(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(b, sizeof(T));
}

// Length-delimited field: key, length, bytes.
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

std::string errno_text() {
  return std::strerror(errno);
}

// The bytes of `data` up to the end of its last whole line, or of its last whole TFRecord
// (length, its CRC, data, its CRC).
uint64_t whole_prefix(const std::string& data, bool records) {
  if (!records) {
    const size_t end = data.rfind('\n');
    return end == std::string::npos ? 0 : end + 1;
  }
  uint64_t at = 0;
  while (data.size() - at >= 16) {  // the smallest record: length, CRC, no data, CRC
    uint64_t length = 0;
    std::memcpy(&length, data.data() + at, 8);
    if (length > data.size() - at - 16) break;
    at += 16 + length;
  }
  return at;
}

// TensorBoard decodes tags and text as UTF-8: a tag that is not drops the rest of its file, text
// that is not fails its TEXT tab. Invalid bytes (a sample cut inside a character) become U+FFFD,
// as in the JSONL files.
std::string valid_utf8(std::string_view s) {
  if (utf8_valid(s)) return std::string(s);
  std::string out;
  utf8_repair(s, out);
  return out;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string out;
  const uint64_t length = data.size();
  std::string len_bytes;
  put_le(len_bytes, length);
  out += len_bytes;
  put_le(out, masked_crc32c(len_bytes.data(), len_bytes.size()));
  out.append(data);
  put_le(out, masked_crc32c(data.data(), data.size()));
  return out;
}

namespace {
// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
// SessionLog session_log = 7 }: one event of wall_time, step and `what` as field `field`.
std::string event_at(double wall_time, int64_t step, int field, const std::string& what) {
  std::string event;
  put_varint(event, 1 << 3 | 1);
  put_le(event, wall_time);
  put_varint(event, 2 << 3 | 0);
  put_varint(event, static_cast<uint64_t>(step));
  put_bytes(event, field, what);
  return event;
}

// An event whose summary holds one Value.
std::string summary_event(double wall_time, int64_t step, const std::string& value) {
  std::string summary;
  put_bytes(summary, 1, value);
  return event_at(wall_time, step, 5, summary);
}
}  // namespace

// Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
std::string scalar_event(double wall_time, int64_t step, std::string_view tag, float value) {
  std::string v;
  put_bytes(v, 1, tag);
  put_varint(v, 2 << 3 | 5);
  put_le(v, value);
  return summary_event(wall_time, step, v);
}

// A text summary as TensorBoard's text plugin reads it: Value { tag = 1; TensorProto tensor = 8;
// SummaryMetadata metadata = 9 }, SummaryMetadata { PluginData plugin_data = 1 { plugin_name = 1 }
// }, TensorProto { dtype = 1 (DT_STRING = 7); TensorShapeProto tensor_shape = 2 { Dim dim = 2 {
// size = 1 } }; repeated bytes string_val = 8 }, one string of shape [1].
std::string text_event(double wall_time, int64_t step, std::string_view tag,
                       std::string_view text) {
  std::string plugin, metadata;
  put_bytes(plugin, 1, "text");
  put_bytes(metadata, 1, plugin);
  std::string dim, shape, tensor;
  put_varint(dim, 1 << 3 | 0);
  put_varint(dim, 1);
  put_bytes(shape, 2, dim);
  put_varint(tensor, 1 << 3 | 0);
  put_varint(tensor, 7);
  put_bytes(tensor, 2, shape);
  put_bytes(tensor, 8, text);
  std::string v;
  put_bytes(v, 1, tag);
  put_bytes(v, 8, tensor);
  put_bytes(v, 9, metadata);
  return summary_event(wall_time, step, v);
}

std::string file_version_event(double wall_time) {
  std::string event;
  put_varint(event, 1 << 3 | 1);
  put_le(event, wall_time);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

// SessionLog { SessionStatus status = 1 (START = 1) }: TensorBoard takes the first START of a run
// as its beginning and each later one as a restart, dropping every point it holds at `step` or
// later.
std::string session_start_event(double wall_time, int64_t step) {
  std::string session_log;
  put_varint(session_log, 1 << 3 | 0);
  put_varint(session_log, 1);
  return event_at(wall_time, step, 7, session_log);
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

AppendFile::AppendFile(const std::filesystem::path& path, std::optional<uint64_t> resume_at,
                       Shortfall shortfall)
    : path_(path) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  if (resume_at && *resume_at > 0 && shortfall != Shortfall::refuse) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec || size < *resume_at) {
      const uint64_t whole =
          ec ? 0 : whole_prefix(read_file(path), shortfall == Shortfall::keep_whole_records);
      log::warn("'", path.string(), "' ",
                ec ? std::string("is missing")
                   : cat("holds ", size, " bytes, fewer than the ", *resume_at,
                         " its checkpoint recorded"),
                ": going on with ", ec ? "a new file" : cat("its first ", whole, " bytes"));
      if (!ec && whole < size) std::filesystem::resize_file(path, whole);
      resume_at = whole;
    }
  }
  if (resume_at && *resume_at == 0) {
    std::FILE* f = std::fopen(path.c_str(), "wb");  // start afresh
    POLLEN_CHECK(f != nullptr, "cannot create '", path.string(), "': ", errno_text());
    std::fclose(f);
  } else if (resume_at) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    POLLEN_CHECK(!ec, "cannot resume '", path.string(), "': ", ec.message());
    POLLEN_CHECK(size >= *resume_at, "'", path.string(), "' holds ", size,
                 " bytes, fewer than the ", *resume_at,
                 " its checkpoint recorded: it was cut or edited since; put back the whole file "
                 "to resume");
    if (size > *resume_at) std::filesystem::resize_file(path, *resume_at);
  }
  file_ = std::fopen(path.c_str(), "ab");
  POLLEN_CHECK(file_ != nullptr, "cannot open '", path.string(), "' for writing: ", errno_text());
  // Unbuffered: each write() is one system call of the whole record, however long, so that a
  // crash leaves whole records (a buffer would send a long one in pieces) and a full disk fails
  // the write that did not fit.
  std::setvbuf(file_, nullptr, _IONBF, 0);
  position_ = resume_at ? *resume_at : static_cast<uint64_t>(std::filesystem::file_size(path));
}

AppendFile::~AppendFile() {
  if (file_) std::fclose(file_);
}

AppendFile::AppendFile(AppendFile&& o) noexcept
    : path_(std::move(o.path_)), file_(o.file_), position_(o.position_) {
  o.file_ = nullptr;
}

AppendFile& AppendFile::operator=(AppendFile&& o) noexcept {
  if (this != &o) {
    if (file_) std::fclose(file_);
    path_ = std::move(o.path_);
    file_ = o.file_;
    position_ = o.position_;
    o.file_ = nullptr;
  }
  return *this;
}

void AppendFile::write(std::string_view bytes) {
  POLLEN_ASSERT(file_ != nullptr);
  POLLEN_CHECK(std::fwrite(bytes.data(), 1, bytes.size(), file_) == bytes.size(), "cannot write '",
               path_.string(), "': ", errno_text());
  position_ += bytes.size();
}

void AppendFile::flush() {
  if (file_) {
    POLLEN_CHECK(std::fflush(file_) == 0, "cannot write '", path_.string(), "': ", errno_text());
  }
}

void AppendFile::sync() {
  if (!file_) return;
  flush();
  POLLEN_CHECK(::fsync(::fileno(file_)) == 0, "cannot sync '", path_.string(), "': ", errno_text());
}

EventFileWriter EventFileWriter::create(const std::filesystem::path& dir,
                                        std::optional<int64_t> session_start) {
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const double now = wall_time_now();
  // TensorBoard reads a folder's files in the order of their names: a later file (a resumed
  // run's, maybe within the same second, from another host or a wrapped-around pid) must sort
  // after the others, so its seconds are past every other file's.
  const std::string prefix = "events.out.tfevents.";
  int64_t seconds = static_cast<int64_t>(now);
  std::error_code unreadable;  // a folder not made yet holds no other file
  for (const auto& entry : std::filesystem::directory_iterator(dir, unreadable)) {
    const std::string file = entry.path().filename().string();
    if (!file.starts_with(prefix)) continue;
    int64_t taken = 0;
    const char* begin = file.data() + prefix.size();
    if (std::from_chars(begin, file.data() + file.size(), taken).ec == std::errc())
      seconds = std::max(seconds, taken + 1);
  }
  EventFileWriter w;
  w.file_ = AppendFile(dir / cat(prefix, seconds, ".", host, ".", ::getpid()));
  w.file_.write(tfrecord(file_version_event(now)));
  if (session_start) w.file_.write(tfrecord(session_start_event(now, *session_start)));
  w.header_bytes_ = w.file_.position();
  return w;
}

void EventFileWriter::discard_if_unused() {
  if (!file_.is_open() || file_.position() != header_bytes_) return;
  const std::filesystem::path path = file_.path();
  file_ = AppendFile();
  std::filesystem::remove(path);
}

EventFileWriter EventFileWriter::resume(const std::filesystem::path& path, uint64_t position,
                                        int64_t restart_step) {
  AppendFile(path, position, Shortfall::keep_whole_records).sync();  // cut back and closed
  return create(path.parent_path(), restart_step);
}

void EventFileWriter::add_scalar(std::string_view tag, double value, int64_t step,
                                 double wall_time) {
  file_.write(tfrecord(scalar_event(wall_time, step, valid_utf8(tag), static_cast<float>(value))));
}

void EventFileWriter::add_text(std::string_view tag, std::string_view text, int64_t step,
                               double wall_time) {
  file_.write(tfrecord(text_event(wall_time, step, valid_utf8(tag), valid_utf8(text))));
}

}  // namespace pollen::obs
