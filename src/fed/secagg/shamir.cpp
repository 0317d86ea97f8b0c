#include "fed/secagg/shamir.h"

#include <openssl/rand.h>

#include <cstring>
#include <set>

#include "base/error.h"

namespace pollen::fed::secagg {

namespace {

__extension__ typedef unsigned __int128 u128;  // GCC and Clang; products of two field values

uint64_t reduce(u128 v) {
  // 2^61 = 1 (mod p): fold the high bits onto the low ones twice.
  uint64_t r = static_cast<uint64_t>(v & kShamirPrime) + static_cast<uint64_t>(v >> 61);
  r = (r & kShamirPrime) + (r >> 61);
  return r >= kShamirPrime ? r - kShamirPrime : r;
}

uint64_t add(uint64_t a, uint64_t b) {
  const uint64_t r = a + b;  // < 2^62: no overflow
  return r >= kShamirPrime ? r - kShamirPrime : r;
}

uint64_t sub(uint64_t a, uint64_t b) {
  return a >= b ? a - b : a + kShamirPrime - b;
}

uint64_t mul(uint64_t a, uint64_t b) {
  return reduce(static_cast<u128>(a) * b);
}

uint64_t inverse(uint64_t a) {  // a^(p-2), a != 0
  uint64_t result = 1, base = a, e = kShamirPrime - 2;
  while (e) {
    if (e & 1) result = mul(result, base);
    base = mul(base, base);
    e >>= 1;
  }
  return result;
}

uint64_t random_element() {
  for (;;) {  // rejection sampling: uniform in [0, p)
    uint64_t v = 0;
    POLLEN_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof v) == 1,
                 "secure aggregation: OpenSSL's random generator failed");
    v &= kShamirPrime;
    if (v < kShamirPrime) return v;
  }
}

}  // namespace

std::vector<Share> share_secret(const Key32& secret, size_t threshold,
                                const std::vector<uint32_t>& xs) {
  POLLEN_CHECK(threshold >= 1 && threshold <= xs.size(), "shamir: threshold ", threshold, " for ",
               xs.size(), " holders");
  POLLEN_CHECK(std::set<uint32_t>(xs.begin(), xs.end()).size() == xs.size() &&
                   !std::set<uint32_t>(xs.begin(), xs.end()).count(0),
               "shamir: holder points must be distinct and non-zero");
  std::vector<Share> out(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) out[i].x = xs[i];
  std::vector<uint64_t> coeff(threshold);
  for (size_t piece = 0; piece < kSharePieces; ++piece) {
    uint32_t value = 0;
    std::memcpy(&value, secret.data() + piece * 4, 4);
    coeff[0] = value;
    for (size_t k = 1; k < threshold; ++k) coeff[k] = random_element();
    for (auto& s : out) {  // Horner at x
      uint64_t y = 0;
      for (size_t k = threshold; k-- > 0;) y = add(mul(y, s.x), coeff[k]);
      s.y[piece] = y;
    }
  }
  return out;
}

namespace {

// The value at `x` of the polynomial through the first `threshold` shares' piece `piece`
// (Lagrange interpolation over GF(p)).
uint64_t interpolate_at(const std::vector<Share>& shares, size_t threshold, size_t piece,
                        uint64_t x) {
  uint64_t v = 0;
  for (size_t i = 0; i < threshold; ++i) {
    uint64_t num = 1, den = 1;
    for (size_t j = 0; j < threshold; ++j) {
      if (j == i) continue;
      num = mul(num, sub(x, shares[j].x));
      den = mul(den, sub(shares[i].x, shares[j].x));
    }
    v = add(v, mul(shares[i].y[piece], mul(num, inverse(den))));
  }
  return v;
}

}  // namespace

Key32 reconstruct_secret(const std::vector<Share>& shares, size_t threshold,
                         const std::string& what) {
  POLLEN_CHECK(threshold >= 1 && shares.size() >= threshold, what, ": ", shares.size(),
               " shares, the threshold is ", threshold);
  std::set<uint32_t> seen;
  for (const Share& s : shares) {
    POLLEN_CHECK(s.x != 0 && seen.insert(s.x).second, what,
                 ": share points must be distinct and non-zero");
  }
  // Shares beyond the threshold must lie on the polynomial the first `threshold` define: a wrong
  // share is caught here, not as a garbage sum after unmasking.
  for (size_t e = threshold; e < shares.size(); ++e) {
    for (size_t piece = 0; piece < kSharePieces; ++piece) {
      POLLEN_CHECK(interpolate_at(shares, threshold, piece, shares[e].x) == shares[e].y[piece],
                   what, ": the shares are inconsistent (the share at point ", shares[e].x,
                   " is not on the polynomial of the first ", threshold,
                   "): a holder revealed a wrong share");
    }
  }
  // Lagrange basis at 0: l_i = prod_{j != i} x_j / (x_j - x_i).
  std::vector<uint64_t> basis(threshold);
  for (size_t i = 0; i < threshold; ++i) {
    uint64_t num = 1, den = 1;
    for (size_t j = 0; j < threshold; ++j) {
      if (j == i) continue;
      num = mul(num, shares[j].x);
      den = mul(den, sub(shares[j].x, shares[i].x));
    }
    basis[i] = mul(num, inverse(den));
  }
  Key32 secret{};
  for (size_t piece = 0; piece < kSharePieces; ++piece) {
    uint64_t v = 0;
    for (size_t i = 0; i < threshold; ++i) v = add(v, mul(basis[i], shares[i].y[piece]));
    POLLEN_CHECK(v <= UINT32_MAX, what, ": the shares are inconsistent (a piece of ", v,
                 " does not fit 32 bits)");
    const auto value = static_cast<uint32_t>(v);
    std::memcpy(secret.data() + piece * 4, &value, 4);
  }
  return secret;
}

std::string share_bytes(const Share& s) {
  std::string out(kShareBytes, '\0');
  std::memcpy(out.data(), s.y.data(), kShareBytes);
  return out;
}

Share share_from(uint32_t x, const std::string& bytes, const std::string& what) {
  POLLEN_CHECK(bytes.size() == kShareBytes, what, ": a share holds ", kShareBytes, " bytes, got ",
               bytes.size());
  Share s;
  s.x = x;
  std::memcpy(s.y.data(), bytes.data(), kShareBytes);
  for (uint64_t v : s.y) POLLEN_CHECK(v < kShamirPrime, what, ": share value not below 2^61 - 1");
  return s;
}

}  // namespace pollen::fed::secagg
