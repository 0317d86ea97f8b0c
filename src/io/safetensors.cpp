#include "io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"

namespace pollen::io {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// An open file that hashes and times everything written to it.
class SyncedWriter {
 public:
  explicit SyncedWriter(const std::filesystem::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    POLLEN_CHECK(fd_ >= 0, "cannot create '", path.string(), "': ", std::strerror(errno));
  }
  ~SyncedWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, size_t size) {
    // Slices are hashed on a second thread while the same slice is written, so a checkpoint
    // costs about max(write, hash), not their sum; the hash still sees the bytes in order.
    constexpr size_t slice = size_t{8} << 20;
    const auto* p = static_cast<const char*>(data);
    for (size_t off = 0; off < size; off += slice) {
      const size_t n = std::min(slice, size - off);
      std::future<double> hashed;
      if (n >= (size_t{1} << 20)) {
        hashed = std::async(std::launch::async, [this, p, off, n] {
          const auto t0 = Clock::now();
          sha_.update(p + off, n);
          return since(t0);
        });
      } else {
        const auto t0 = Clock::now();
        sha_.update(p + off, n);
        stats_.hash_s += since(t0);
      }
      const auto t0 = Clock::now();
      size_t done = 0;
      while (done < n) {
        const ssize_t w = ::write(fd_, p + off + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          if (hashed.valid()) hashed.wait();
          fail("cannot write '", path_.string(), "': ", std::strerror(errno));
        }
        done += static_cast<size_t>(w);
      }
      stats_.serialise_s += since(t0);
      if (hashed.valid()) stats_.hash_s += hashed.get();
    }
    stats_.bytes += size;
  }
  WriteStats finish() {
    const auto t0 = Clock::now();
    POLLEN_CHECK(::fsync(fd_) == 0, "cannot sync '", path_.string(), "': ", std::strerror(errno));
    POLLEN_CHECK(::close(fd_) == 0, "cannot close '", path_.string(), "': ", std::strerror(errno));
    fd_ = -1;
    stats_.sync_s += since(t0);
    stats_.sha256 = sha_.hex_digest();
    return stats_;
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  Sha256 sha_;
  WriteStats stats_;
};

}  // namespace

std::string safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return "F64";
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i64:
      return "I64";
    case DType::i32:
      return "I32";
    case DType::u32:
      return "U32";
    case DType::u16:
      return "U16";
    case DType::u8:
      return "U8";
  }
  fail("safetensors: unsupported dtype");
}

DType parse_safetensors_dtype(const std::string& name, const std::string& where) {
  for (DType d : {DType::f64, DType::f32, DType::bf16, DType::f16, DType::i64, DType::i32,
                  DType::u32, DType::u16, DType::u8}) {
    if (safetensors_dtype(d) == name) return d;
  }
  fail(where, ": dtype '", name, "' is not supported (expected F64, F32, BF16, F16, I64, I32, ",
       "U32, U16 or U8)");
}

WriteStats write_file_synced(const std::filesystem::path& path, std::string_view data) {
  SyncedWriter w(path);
  w.write(data.data(), data.size());
  return w.finish();
}

WriteStats write_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                             const std::map<std::string, std::string>& metadata) {
  const auto t0 = Clock::now();
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<Tensor> contiguous;
  contiguous.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    POLLEN_CHECK(!header.contains(name), "safetensors '", path.string(), "': tensor name '", name,
                 "' appears twice");
    POLLEN_CHECK(t.device() == Device::cpu, "safetensors: tensor '", name, "' is not on the CPU");
    contiguous.push_back(t.is_contiguous() ? t : t.contiguous());
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const uint64_t header_len = text.size();
  char len_bytes[8];
  std::memcpy(len_bytes, &header_len, 8);
  const double build_s = since(t0);

  SyncedWriter w(path);
  w.write(len_bytes, 8);
  w.write(text.data(), text.size());
  for (const auto& t : contiguous) w.write(t.raw(), t.nbytes());
  WriteStats s = w.finish();
  s.serialise_s += build_s;
  return s;
}

const Tensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

SafetensorsFile parse_safetensors(const std::byte* data, size_t size, const std::string& source) {
  constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  const std::string where = cat("safetensors file '", source, "'");
  POLLEN_CHECK(size >= 8, where, ": ", size, " bytes is too short for the 8-byte header length");
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);
  POLLEN_CHECK(header_len <= kMaxHeaderBytes, where, ": header length ", header_len,
               " is over the 100 MB limit");
  POLLEN_CHECK(header_len <= size - 8, where, ": header length ", header_len,
               " runs past the end of the file (", size, " bytes): it is truncated");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(data) + 8,
                                   reinterpret_cast<const char*>(data) + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": header is not valid JSON: ", e.what());
  }
  POLLEN_CHECK(header.is_object(), where, ": header must be a JSON object");
  const std::byte* payload = data + 8 + header_len;
  const uint64_t payload_size = size - 8 - header_len;

  SafetensorsFile out;
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      POLLEN_CHECK(entry.is_object(), where, ": __metadata__ must be an object of strings");
      for (const auto& [k, v] : entry.items()) {
        POLLEN_CHECK(v.is_string(), where, ": __metadata__ value '", k, "' must be a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string at = cat(where, ", tensor '", name, "'");
    POLLEN_CHECK(entry.is_object(), at, ": expected an object with dtype, shape, data_offsets");
    for (const auto& [k, v] : entry.items()) {
      POLLEN_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", at, ": unknown field '", k,
                   "'");
    }
    POLLEN_CHECK(entry.contains("dtype") && entry["dtype"].is_string(), at,
                 ": dtype missing or not a string");
    POLLEN_CHECK(entry.contains("shape") && entry["shape"].is_array(), at,
                 ": shape missing or not an array");
    POLLEN_CHECK(entry.contains("data_offsets") && entry["data_offsets"].is_array() &&
                     entry["data_offsets"].size() == 2,
                 at, ": data_offsets missing or not [begin, end]");
    const DType dtype = parse_safetensors_dtype(entry["dtype"].get<std::string>(), at);
    Shape shape;
    uint64_t numel = 1;
    for (const auto& d : entry["shape"]) {
      POLLEN_CHECK(d.is_number_unsigned(), at, ": shape entries must be non-negative integers");
      const uint64_t v = d.get<uint64_t>();
      POLLEN_CHECK(v < (uint64_t{1} << 40) && (v == 0 || numel <= (uint64_t{1} << 50) / v), at,
                   ": shape ", entry["shape"].dump(), " is too large");
      numel *= v;
      shape.push_back(static_cast<int64_t>(v));
    }
    for (const auto& o : entry["data_offsets"]) {
      POLLEN_CHECK(o.is_number_unsigned(), at, ": data_offsets must be non-negative integers");
    }
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    POLLEN_CHECK(begin <= end, at, ": data_offsets [", begin, ", ", end, "] end before they begin");
    POLLEN_CHECK(end <= payload_size, at, ": data_offsets [", begin, ", ", end,
                 "] fall outside the ", payload_size,
                 " data bytes (the file is truncated or the offsets are wrong)");
    POLLEN_CHECK(end - begin == numel * dtype_size(dtype), at, ": data_offsets span ", end - begin,
                 " bytes but shape ", entry["shape"].dump(), " of ",
                 entry["dtype"].get<std::string>(), " needs ", numel * dtype_size(dtype));
    ranges.push_back({begin, end, name});
    Tensor t = Tensor::empty(shape, dtype);
    if (end > begin) std::memcpy(t.raw(), payload + begin, end - begin);
    out.tensors.emplace_back(name, std::move(t));
  }
  // The tensors must tile the data area exactly: no overlap, no hole.
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return ranges[a].begin != ranges[b].begin ? ranges[a].begin < ranges[b].begin
                                              : ranges[a].end < ranges[b].end;
  });
  NamedTensors sorted;  // file order, as written
  for (size_t i : order) sorted.push_back(std::move(out.tensors[i]));
  out.tensors = std::move(sorted);
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  for (const auto& r : ranges) {
    POLLEN_CHECK(r.begin == expect, where, ": tensor '", r.name, "' starts at byte ", r.begin,
                 " of the data but ", expect, " was expected (overlap or hole)");
    expect = r.end;
  }
  POLLEN_CHECK(expect == payload_size, where, ": ", payload_size - expect,
               " bytes after the last tensor belong to none");
  return out;
}

SafetensorsFile read_safetensors(const std::filesystem::path& path) {
  MappedFile f(path);
  return parse_safetensors(f.data(), f.size(), path.string());
}

}  // namespace pollen::io
