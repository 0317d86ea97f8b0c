#pragma once
// safetensors (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}},
// then the tensors' bytes. Writing hashes the bytes as they go out (no second read) and times
// serialising, hashing and syncing apart; reading checks every header field and says what is
// wrong, with the file's name, instead of trusting it.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace pollen::io {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// serialise_s: writing the bytes out (to the page cache, and to disk as its dirty limit is
// reached); hash_s: SHA-256 time, on a second thread overlapping the writes; sync_s: fsync.
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

// Writes (and fsyncs) a safetensors file; names must be unique.
WriteStats write_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                             const std::map<std::string, std::string>& metadata = {});
// Writes bytes to a new file, hashing and syncing it, with the same timing split.
WriteStats write_file_synced(const std::filesystem::path& path, std::string_view data);

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  NamedTensors tensors;  // in file order
  const Tensor* find(const std::string& name) const;
};

SafetensorsFile read_safetensors(const std::filesystem::path& path);
// Parses a whole file's bytes; `source` names it in errors.
SafetensorsFile parse_safetensors(const std::byte* data, size_t size, const std::string& source);

// "F32" <-> DType::f32 and so on.
std::string safetensors_dtype(DType dtype);
DType parse_safetensors_dtype(const std::string& name, const std::string& where);

}  // namespace pollen::io
