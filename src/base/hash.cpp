#include "base/hash.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <fstream>
#include <vector>

#include "base/error.h"

namespace pollen {

uint64_t xxh64(const void* data, size_t size, uint64_t seed) {
  return XXH64(data, size, seed);
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  POLLEN_CHECK(ctx_ && EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr),
               "SHA-256: OpenSSL could not start a digest");
}
Sha256::~Sha256() {
  EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_));
}

void Sha256::update(const void* data, size_t size) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size);
}

std::array<uint8_t, 32> Sha256::digest() {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), out.data(), &len);
  return out;
}

std::string Sha256::hex_digest() {
  auto d = digest();
  return to_hex(d.data(), d.size());
}

std::string to_hex(const uint8_t* data, size_t size) {
  static const char* digits = "0123456789abcdef";
  std::string s(size * 2, '0');
  for (size_t i = 0; i < size; ++i) {
    s[2 * i] = digits[data[i] >> 4];
    s[2 * i + 1] = digits[data[i] & 15];
  }
  return s;
}

std::string sha256_hex(std::string_view data) {
  Sha256 h;
  h.update(data);
  return h.hex_digest();
}

std::string sha256_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  POLLEN_CHECK(in, "cannot open '", path.string(), "' for reading");
  Sha256 h;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    h.update(buf.data(), static_cast<size_t>(in.gcount()));
  }
  POLLEN_CHECK(in.eof(), "error while reading '", path.string(), "'");
  return h.hex_digest();
}

}  // namespace pollen
