#include "io/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "io/folder_swap.h"

namespace pollen::io {

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

SafetensorsLayout layout_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  SafetensorsLayout layout;
  layout.tensors.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    POLLEN_CHECK(!header.contains(name), "safetensors '", path.string(), "': tensor name '", name,
                 "' appears twice");
    POLLEN_CHECK(t.device() == Device::cpu, "safetensors: tensor '", name, "' is not on the CPU");
    layout.tensors.push_back(t.is_contiguous() ? t : t.contiguous());
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const uint64_t header_len = text.size();
  layout.head.resize(8);
  std::memcpy(layout.head.data(), &header_len, 8);
  layout.head += text;
  return layout;
}

ByteSpans SafetensorsLayout::pieces() const {
  ByteSpans p{std::as_bytes(std::span(head))};
  for (const auto& t : tensors) p.emplace_back(static_cast<const std::byte*>(t.raw()), t.nbytes());
  return p;
}

WriteStats write_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                             const std::map<std::string, std::string>& metadata) {
  const auto t0 = std::chrono::steady_clock::now();
  const SafetensorsLayout layout = layout_safetensors(path, tensors, metadata);
  const std::chrono::duration<double> laid_out = std::chrono::steady_clock::now() - t0;
  WriteStats s = write_synced(path, layout.pieces());
  s.serialise_s += laid_out.count();
  return s;
}

WriteStats write_safetensors_atomic(const std::filesystem::path& path, const NamedTensors& tensors,
                                    const std::map<std::string, std::string>& metadata) {
  const std::filesystem::path dir =
      path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  const std::filesystem::path tmp = dir / cat(".", path.filename().string(), ".tmp.", ::getpid());
  WriteStats s;
  try {
    s = write_safetensors(tmp, tensors, metadata);
    std::filesystem::rename(tmp, path);
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw;
  }
  sync_folder(dir);
  return s;
}

const Tensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

namespace {

// One header entry, checked but not yet read: where its bytes lie in the data area.
struct EntryLayout {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

EntryLayout check_entry(const std::string& name, const nlohmann::json& entry, uint64_t payload_size,
                        const std::string& where) {
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
  EntryLayout e{name, parse_safetensors_dtype(entry["dtype"].get<std::string>(), at), {}, 0, 0};
  uint64_t numel = 1;
  for (const auto& d : entry["shape"]) {
    POLLEN_CHECK(d.is_number_unsigned(), at, ": shape entries must be non-negative integers");
    const uint64_t v = d.get<uint64_t>();
    POLLEN_CHECK(v < (uint64_t{1} << 40) && (v == 0 || numel <= (uint64_t{1} << 50) / v), at,
                 ": shape ", entry["shape"].dump(), " is too large");
    numel *= v;
    e.shape.push_back(static_cast<int64_t>(v));
  }
  for (const auto& o : entry["data_offsets"]) {
    POLLEN_CHECK(o.is_number_unsigned(), at, ": data_offsets must be non-negative integers");
  }
  e.begin = entry["data_offsets"][0].get<uint64_t>();
  e.end = entry["data_offsets"][1].get<uint64_t>();
  POLLEN_CHECK(e.begin <= e.end, at, ": data_offsets [", e.begin, ", ", e.end,
               "] end before they begin");
  POLLEN_CHECK(e.end <= payload_size, at, ": data_offsets [", e.begin, ", ", e.end,
               "] fall outside the ", payload_size,
               " data bytes (the file is truncated or the offsets are wrong)");
  POLLEN_CHECK(e.end - e.begin == numel * dtype_size(e.dtype), at, ": data_offsets span ",
               e.end - e.begin, " bytes but shape ", entry["shape"].dump(), " of ",
               entry["dtype"].get<std::string>(), " needs ", numel * dtype_size(e.dtype));
  return e;
}

// Sorts the entries into file order and checks that they tile the data area exactly: no
// overlap, no hole. Done before any tensor is allocated, so that entries aliasing the same
// bytes cannot make the reader allocate many times the file's size.
void check_tiling(std::vector<EntryLayout>& entries, uint64_t payload_size,
                  const std::string& where) {
  std::stable_sort(entries.begin(), entries.end(), [](const EntryLayout& a, const EntryLayout& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  for (const auto& e : entries) {
    POLLEN_CHECK(e.begin == expect, where, ": tensor '", e.name, "' starts at byte ", e.begin,
                 " of the data but ", expect, " was expected (overlap or hole)");
    expect = e.end;
  }
  POLLEN_CHECK(expect == payload_size, where, ": ", payload_size - expect,
               " bytes after the last tensor belong to none");
}

}  // namespace

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
  const std::string_view header_text(reinterpret_cast<const char*>(data) + 8, header_len);
  check_json_depth(header_text, cat(where, ": header"));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_text);
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": header is not valid JSON: ", e.what());
  }
  POLLEN_CHECK(header.is_object(), where, ": header must be a JSON object");
  const std::byte* payload = data + 8 + header_len;
  const uint64_t payload_size = size - 8 - header_len;

  SafetensorsFile out;
  std::vector<EntryLayout> entries;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      POLLEN_CHECK(entry.is_object(), where, ": __metadata__ must be an object of strings");
      for (const auto& [k, v] : entry.items()) {
        POLLEN_CHECK(v.is_string(), where, ": __metadata__ value '", k, "' must be a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(check_entry(name, entry, payload_size, where));
  }
  check_tiling(entries, payload_size, where);
  out.tensors.reserve(entries.size());
  for (const EntryLayout& e : entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (e.end > e.begin) std::memcpy(t.raw(), payload + e.begin, e.end - e.begin);
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

SafetensorsFile read_safetensors(const std::filesystem::path& path) {
  MappedFile f(path);
  return parse_safetensors(f.data(), f.size(), path.string());
}

}  // namespace pollen::io
