#pragma once
// Hashing: xxHash64 for fast non-cryptographic fingerprints, SHA-256 for manifests and checksums.
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace pollen {

uint64_t xxh64(const void* data, size_t size, uint64_t seed = 0);

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t size);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::array<uint8_t, 32> digest();
  std::string hex_digest();

 private:
  void* ctx_;
};

std::string sha256_hex(std::string_view data);
std::string sha256_file(const std::filesystem::path& path);
std::string to_hex(const uint8_t* data, size_t size);

}  // namespace pollen
