#include "dist/communicator.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include <unistd.h>

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
