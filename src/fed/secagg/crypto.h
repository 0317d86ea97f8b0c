#pragma once
// The cryptography of secure aggregation, all through OpenSSL's EVP interface:
//
//   key agreement   X25519 (RFC 7748): 32-byte secret and public keys, 32-byte shared secret
//   key derivation  HKDF-SHA256 (RFC 5869) of a shared secret, bound to a context string
//   share transport AES-256-GCM with a random 96-bit nonce: nonce || ciphertext || 16-byte tag
//   mask streams    AES-256-CTR keystream (zero IV) read as little-endian ring words
//
// Every secret and key is a Key32. Nothing here keeps state.
#include <array>
#include <cstdint>
#include <string>

namespace pollen::fed::secagg {

using Key32 = std::array<uint8_t, 32>;

constexpr size_t kNonceBytes = 12;
constexpr size_t kTagBytes = 16;

Key32 random_key();  // OpenSSL's CSPRNG

struct KeyPair {
  Key32 secret{}, public_key{};
  static KeyPair generate();
};

// The X25519 public key of a secret key.
Key32 public_key_of(const Key32& secret);
// X25519(secret, peer_public); throws naming `what` when the peer's key is degenerate.
Key32 agree(const Key32& secret, const Key32& peer_public, const std::string& what);
// HKDF-SHA256 with an empty salt: 32 bytes bound to `context`.
Key32 derive(const Key32& input, const std::string& context);

// AES-256-GCM: nonce || ciphertext || tag. `aad` is authenticated, not sent.
std::string seal(const Key32& key, const std::string& aad, const std::string& plaintext);
// Throws naming `what` when the ciphertext is malformed or does not authenticate.
std::string open(const Key32& key, const std::string& aad, const std::string& sealed,
                 const std::string& what);

// Adds (sign +1) or subtracts (sign -1) the AES-256-CTR stream of `seed` to out[0, n), one
// word of ring_bits / 8 little-endian bytes per element, modulo 2^ring_bits.
void add_mask(const Key32& seed, int sign, int ring_bits, uint64_t* out, size_t n);

std::string key_string(const Key32& k);
// Throws naming `what` unless `bytes` holds exactly 32 bytes.
Key32 key_from(const std::string& bytes, const std::string& what);

}  // namespace pollen::fed::secagg
