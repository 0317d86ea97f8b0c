#pragma once
// Shamir secret sharing (Shamir 1979) of 32-byte secrets over the prime field GF(p),
// p = 2^61 - 1. A secret is cut into eight 32-bit pieces; each piece is the constant term of
// its own random polynomial of degree threshold - 1, and the share of holder x (1 ... 2^32 - 1)
// is the eight polynomials' values at x. Any `threshold` distinct shares give the secret back
// (Lagrange interpolation at 0); fewer reveal nothing about it.
#include <cstdint>
#include <string>
#include <vector>

#include "fed/secagg/crypto.h"

namespace pollen::fed::secagg {

constexpr uint64_t kShamirPrime = (uint64_t{1} << 61) - 1;
constexpr size_t kSharePieces = 8;                // 32-bit pieces of a 32-byte secret
constexpr size_t kShareBytes = kSharePieces * 8;  // one field element (8 bytes LE) per piece

struct Share {
  uint32_t x = 0;  // the holder's evaluation point, never 0
  std::array<uint64_t, kSharePieces> y{};
};

// One share per holder point in `xs` (distinct, non-zero); 1 <= threshold <= xs.size().
std::vector<Share> share_secret(const Key32& secret, size_t threshold,
                                const std::vector<uint32_t>& xs);

// The secret from at least `threshold` shares with distinct points (the first `threshold` are
// used, and any more must agree with them); throws naming `what` when there are fewer, or when
// the shares are inconsistent (a holder revealed a wrong one).
Key32 reconstruct_secret(const std::vector<Share>& shares, size_t threshold,
                         const std::string& what);

// Share values as kShareBytes bytes; parsing checks the size and that every value is < p.
std::string share_bytes(const Share& s);
Share share_from(uint32_t x, const std::string& bytes, const std::string& what);

}  // namespace pollen::fed::secagg
