#include "dist/communicator.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <unistd.h>

#include "base/thread_pool.h"
#include "dist/mpi_communicator.h"

namespace pollen::dist {

void Communicator::barrier(std::string what) {
  double none = 0;
  all_reduce_sum(std::span<double>(&none, 1), std::move(what));
}

std::string Communicator::placement() {
  // Per rank: local rank, ranks on its node, then its host name one byte per value (a sum in
  // which only that rank's slot is non-zero, so exact).
  constexpr size_t kHost = 64, kSlot = 2 + kHost;
  std::vector<double> slots(kSlot * static_cast<size_t>(world()), 0.0);
  double* mine = slots.data() + kSlot * static_cast<size_t>(rank());
  mine[0] = topology_.local_rank;
  mine[1] = topology_.local_world;
  char host[kHost] = {};
  gethostname(host, kHost - 1);
  for (size_t i = 0; i < kHost; ++i) mine[2 + i] = static_cast<unsigned char>(host[i]);
  all_reduce_sum(slots, "the placement of the ranks");
  std::string out;
  for (int r = 0; r < world(); ++r) {
    const double* s = slots.data() + kSlot * static_cast<size_t>(r);
    std::string name;
    for (size_t i = 0; i < kHost && s[2 + i] != 0; ++i) name += static_cast<char>(s[2 + i]);
    out += (r ? ", " : "") + std::to_string(r) + " on " + name + " (local " +
           std::to_string(static_cast<int>(s[0])) + " of " +
           std::to_string(static_cast<int>(s[1])) + ")";
  }
  return out;
}

int Communicator::threads_per_rank() {
  // Per rank: its host name one byte per value, then its CPUs 32 to a value (exact sums: only
  // that rank's slot is non-zero).
  constexpr size_t kHost = 64, kWords = CpuMask().size() / 32, kSlot = kHost + kWords;
  const CpuMask mask = affinity_mask();
  std::vector<double> slots(kSlot * static_cast<size_t>(world()), 0.0);
  double* mine = slots.data() + kSlot * static_cast<size_t>(rank());
  char host[kHost] = {};
  gethostname(host, kHost - 1);
  for (size_t i = 0; i < kHost; ++i) mine[i] = static_cast<unsigned char>(host[i]);
  for (size_t cpu = 0; cpu < mask.size(); ++cpu)
    if (mask[cpu]) mine[kHost + cpu / 32] += static_cast<double>(uint64_t{1} << (cpu % 32));
  if (world() > 1) all_reduce_sum(slots, "the CPUs of the ranks");
  std::vector<CpuMask> node;
  for (int r = 0; r < world(); ++r) {
    const double* s = slots.data() + kSlot * static_cast<size_t>(r);
    if (!std::equal(s, s + kHost, mine)) continue;
    CpuMask m;
    for (size_t w = 0; w < kWords; ++w) {
      const auto bits = static_cast<uint64_t>(s[kHost + w]);
      for (size_t b = 0; b < 32; ++b)
        if (bits >> b & 1) m.set(w * 32 + b);
    }
    node.push_back(m);
  }
  return pollen::threads_per_rank(mask, node);
}

Request SingleProcess::start_reduce_scatter(const float* in, float* out, int64_t n, std::string) {
  if (in != out) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
  return 0;
}

Request SingleProcess::start_all_gather(const float* in, float* out, int64_t n, std::string) {
  if (in != out) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
  return 0;
}

void SingleProcess::abort_job(int exit_code) {
  std::exit(exit_code);
}

std::unique_ptr<Communicator> connect(double timeout_s) {
  const Topology t = topology_from_environment();
  if (!t.distributed()) return std::make_unique<SingleProcess>();
  check_joinable(t);
  return std::make_unique<MpiCommunicator>(t, timeout_s);
}

}  // namespace pollen::dist
