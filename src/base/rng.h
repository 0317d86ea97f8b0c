#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011): the value at (key, counter)
// is a pure function, so any element of any stream can be drawn independently and in parallel,
// and a generator's whole state is two integers that checkpoints can store.
#include <array>
#include <cstdint>

namespace pollen {

// 64 bits from the kernel's CSPRNG (getrandom): a seed that must stay secret (noise that hides
// counts), where a reproducible one would let others subtract it.
uint64_t os_entropy_u64();

// One Philox4x32-10 block: 128 random bits for a 64-bit key and a 128-bit counter.
std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo);

class Rng {
 public:
  explicit Rng(uint64_t seed = 0, uint64_t offset = 0) : seed_(seed), offset_(offset) {}

  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }  // how many 128-bit blocks were drawn

  uint32_t next_u32();
  uint64_t next_u64();
  double uniform();            // [0, 1) with 53 random bits
  double normal();             // standard normal (Box-Muller on two uniforms)
  uint64_t below(uint64_t n);  // uniform in [0, n), n > 0, unbiased

  // Derives an independent stream for a sub-task (layer i, rank r, ...).
  Rng fork(uint64_t stream) const;

 private:
  uint64_t seed_;
  uint64_t offset_;
  std::array<uint32_t, 4> block_{};
  int used_ = 4;
};

}  // namespace pollen
