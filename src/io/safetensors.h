#pragma once
// safetensors (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}},
// then the tensors' bytes. Writing goes through write_synced (hashed beside the writes, timed
// per phase); reading checks every header field and says what is wrong, with the file's name,
// instead of trusting it.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "io/synced_write.h"
#include "tensor/tensor.h"

namespace pollen::io {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// A safetensors file as pieces of memory: the 8-byte header length and the header, then each
// tensor's bytes (held, not copied, unless a tensor was not contiguous). `path` names the file
// in errors.
struct SafetensorsLayout {
  std::string head;
  std::vector<Tensor> tensors;
  ByteSpans pieces() const;
};
SafetensorsLayout layout_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                     const std::map<std::string, std::string>& metadata = {});

// Writes (and fsyncs) a safetensors file; names must be unique.
WriteStats write_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                             const std::map<std::string, std::string>& metadata = {});

// As write_safetensors, atomically: the file is written beside `path` under a temporary name
// (".NAME.tmp.PID"), synced, renamed over `path` and the folder synced. Readers see the old
// file or the whole new one; when writing fails (a full disk), the temporary file is removed
// and `path` is left as it was.
WriteStats write_safetensors_atomic(const std::filesystem::path& path, const NamedTensors& tensors,
                                    const std::map<std::string, std::string>& metadata = {});

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
