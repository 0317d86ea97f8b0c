#include "fed/secagg/crypto.h"

#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <vector>

#include "base/error.h"

namespace pollen::fed::secagg {

static_assert(std::endian::native == std::endian::little, "mask words are read little-endian");

namespace {

struct PkeyFree {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
struct PkeyCtxFree {
  void operator()(EVP_PKEY_CTX* p) const { EVP_PKEY_CTX_free(p); }
};
struct CipherCtxFree {
  void operator()(EVP_CIPHER_CTX* p) const { EVP_CIPHER_CTX_free(p); }
};
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;
using PkeyCtx = std::unique_ptr<EVP_PKEY_CTX, PkeyCtxFree>;
using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, CipherCtxFree>;

Pkey private_key(const Key32& secret) {
  Pkey k(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, secret.data(), secret.size()));
  POLLEN_CHECK(k != nullptr, "secure aggregation: OpenSSL refused an X25519 secret key");
  return k;
}

CipherCtx cipher_ctx() {
  CipherCtx c(EVP_CIPHER_CTX_new());
  POLLEN_CHECK(c != nullptr, "secure aggregation: out of memory for a cipher context");
  return c;
}

}  // namespace

Key32 random_key() {
  Key32 k;
  POLLEN_CHECK(RAND_bytes(k.data(), static_cast<int>(k.size())) == 1,
               "secure aggregation: OpenSSL's random generator failed");
  return k;
}

Key32 public_key_of(const Key32& secret) {
  Pkey k = private_key(secret);
  Key32 pub;
  size_t n = pub.size();
  POLLEN_CHECK(EVP_PKEY_get_raw_public_key(k.get(), pub.data(), &n) == 1 && n == pub.size(),
               "secure aggregation: cannot derive an X25519 public key");
  return pub;
}

KeyPair KeyPair::generate() {
  KeyPair p;
  p.secret = random_key();
  p.public_key = public_key_of(p.secret);
  return p;
}

Key32 agree(const Key32& secret, const Key32& peer_public, const std::string& what) {
  Pkey mine = private_key(secret);
  Pkey peer(EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, peer_public.data(),
                                        peer_public.size()));
  POLLEN_CHECK(peer != nullptr, what, ": not an X25519 public key");
  PkeyCtx ctx(EVP_PKEY_CTX_new(mine.get(), nullptr));
  Key32 shared;
  size_t n = shared.size();
  // OpenSSL refuses low-order points (an all-zero shared secret) here.
  const bool ok = ctx && EVP_PKEY_derive_init(ctx.get()) == 1 &&
                  EVP_PKEY_derive_set_peer(ctx.get(), peer.get()) == 1 &&
                  EVP_PKEY_derive(ctx.get(), shared.data(), &n) == 1 && n == shared.size();
  POLLEN_CHECK(ok, what, ": X25519 key agreement failed (degenerate public key)");
  return shared;
}

Key32 derive(const Key32& input, const std::string& context) {
  PkeyCtx ctx(EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr));
  Key32 out;
  size_t n = out.size();
  const bool ok =
      ctx && EVP_PKEY_derive_init(ctx.get()) == 1 &&
      EVP_PKEY_CTX_set_hkdf_md(ctx.get(), EVP_sha256()) == 1 &&
      EVP_PKEY_CTX_set1_hkdf_key(ctx.get(), input.data(), static_cast<int>(input.size())) == 1 &&
      EVP_PKEY_CTX_add1_hkdf_info(ctx.get(), reinterpret_cast<const unsigned char*>(context.data()),
                                  static_cast<int>(context.size())) == 1 &&
      EVP_PKEY_derive(ctx.get(), out.data(), &n) == 1 && n == out.size();
  POLLEN_CHECK(ok, "secure aggregation: HKDF-SHA256 failed");
  return out;
}

std::string seal(const Key32& key, const std::string& aad, const std::string& plaintext) {
  std::string out(kNonceBytes + plaintext.size() + kTagBytes, '\0');
  auto* o = reinterpret_cast<unsigned char*>(out.data());
  POLLEN_CHECK(RAND_bytes(o, kNonceBytes) == 1, "secure aggregation: random generator failed");
  CipherCtx c = cipher_ctx();
  int len = 0, fin = 0;
  const bool ok =
      EVP_EncryptInit_ex(c.get(), EVP_aes_256_gcm(), nullptr, key.data(), o) == 1 &&
      EVP_EncryptUpdate(c.get(), nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                        static_cast<int>(aad.size())) == 1 &&
      EVP_EncryptUpdate(c.get(), o + kNonceBytes, &len,
                        reinterpret_cast<const unsigned char*>(plaintext.data()),
                        static_cast<int>(plaintext.size())) == 1 &&
      EVP_EncryptFinal_ex(c.get(), o + kNonceBytes + len, &fin) == 1 &&
      EVP_CIPHER_CTX_ctrl(c.get(), EVP_CTRL_GCM_GET_TAG, kTagBytes,
                          o + kNonceBytes + plaintext.size()) == 1;
  POLLEN_CHECK(ok && static_cast<size_t>(len + fin) == plaintext.size(),
               "secure aggregation: AES-256-GCM encryption failed");
  return out;
}

std::string open(const Key32& key, const std::string& aad, const std::string& sealed,
                 const std::string& what) {
  POLLEN_CHECK(sealed.size() >= kNonceBytes + kTagBytes, what, ": ciphertext of ", sealed.size(),
               " bytes is shorter than nonce and tag");
  const size_t n = sealed.size() - kNonceBytes - kTagBytes;
  const auto* s = reinterpret_cast<const unsigned char*>(sealed.data());
  std::string out(n, '\0');
  CipherCtx c = cipher_ctx();
  std::array<unsigned char, kTagBytes> tag;
  std::memcpy(tag.data(), s + kNonceBytes + n, kTagBytes);
  int len = 0, fin = 0;
  const bool ok =
      EVP_DecryptInit_ex(c.get(), EVP_aes_256_gcm(), nullptr, key.data(), s) == 1 &&
      EVP_DecryptUpdate(c.get(), nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                        static_cast<int>(aad.size())) == 1 &&
      EVP_DecryptUpdate(c.get(), reinterpret_cast<unsigned char*>(out.data()), &len,
                        s + kNonceBytes, static_cast<int>(n)) == 1 &&
      EVP_CIPHER_CTX_ctrl(c.get(), EVP_CTRL_GCM_SET_TAG, kTagBytes, tag.data()) == 1 &&
      EVP_DecryptFinal_ex(c.get(), reinterpret_cast<unsigned char*>(out.data()) + len, &fin) == 1;
  POLLEN_CHECK(ok, what, ": the ciphertext does not authenticate (wrong key, sender or round)");
  return out;
}

void add_mask(const Key32& seed, int sign, int ring_bits, uint64_t* out, size_t n) {
  POLLEN_ASSERT(ring_bits == 32 || ring_bits == 64);
  POLLEN_ASSERT(sign == 1 || sign == -1);
  const size_t word = static_cast<size_t>(ring_bits) / 8;
  const uint64_t mask = ring_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << ring_bits) - 1;
  CipherCtx c = cipher_ctx();
  const std::array<unsigned char, 16> iv{};
  POLLEN_CHECK(EVP_EncryptInit_ex(c.get(), EVP_aes_256_ctr(), nullptr, seed.data(), iv.data()) == 1,
               "secure aggregation: AES-256-CTR failed");
  constexpr size_t kBlockWords = 8192;
  std::vector<unsigned char> zeros(kBlockWords * 8, 0), stream(kBlockWords * 8 + 16);
  for (size_t start = 0; start < n; start += kBlockWords) {
    const size_t m = std::min(kBlockWords, n - start);
    int len = 0;
    POLLEN_CHECK(EVP_EncryptUpdate(c.get(), stream.data(), &len, zeros.data(),
                                   static_cast<int>(m * word)) == 1 &&
                     static_cast<size_t>(len) == m * word,
                 "secure aggregation: AES-256-CTR failed");
    for (size_t j = 0; j < m; ++j) {
      uint64_t w = 0;
      std::memcpy(&w, stream.data() + j * word, word);  // little-endian hosts only
      out[start + j] = (sign > 0 ? out[start + j] + w : out[start + j] - w) & mask;
    }
  }
}

std::string key_string(const Key32& k) {
  return std::string(reinterpret_cast<const char*>(k.data()), k.size());
}

Key32 key_from(const std::string& bytes, const std::string& what) {
  POLLEN_CHECK(bytes.size() == 32, what, ": expected 32 bytes, got ", bytes.size());
  Key32 k;
  std::memcpy(k.data(), bytes.data(), 32);
  return k;
}

}  // namespace pollen::fed::secagg
