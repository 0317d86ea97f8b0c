#include "base/rng.h"

#include <sys/random.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "base/error.h"
#include "base/hash.h"

namespace pollen {

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo) {
  constexpr uint32_t kMul0 = 0xD2511F53, kMul1 = 0xCD9E8D57;
  constexpr uint32_t kWeyl0 = 0x9E3779B9, kWeyl1 = 0xBB67AE85;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = static_cast<uint32_t>(p1);
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += kWeyl0, k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

uint32_t Rng::next_u32() {
  if (used_ == 4) {
    block_ = philox4x32(seed_, 0, offset_++);
    used_ = 0;
  }
  return block_[used_++];
}

uint64_t os_entropy_u64() {
  uint64_t v = 0;
  ssize_t got = -1;
  do {
    got = ::getrandom(&v, sizeof v, 0);
  } while (got < 0 && errno == EINTR);
  POLLEN_CHECK(got == static_cast<ssize_t>(sizeof v), "getrandom: ", std::strerror(errno));
  return v;
}

uint64_t Rng::next_u64() {
  uint64_t hi = next_u32();
  return (hi << 32) | next_u32();
}

double Rng::uniform() {
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
}

double Rng::normal() {
  double u1 = uniform(), u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

__extension__ typedef unsigned __int128 u128;

uint64_t Rng::below(uint64_t n) {
  // Lemire's nearly-divisionless method with rejection: exact uniformity.
  uint64_t threshold = (0 - n) % n;
  for (;;) {
    u128 m = static_cast<u128>(next_u64()) * n;
    if (static_cast<uint64_t>(m) >= threshold) return static_cast<uint64_t>(m >> 64);
  }
}

Rng Rng::fork(uint64_t stream) const {
  uint64_t parts[2] = {seed_, stream};
  return Rng(xxh64(parts, sizeof(parts), 0x706f6c6c656eULL));
}

}  // namespace pollen
