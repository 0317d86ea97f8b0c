#include "dist/communicator.h"

#include <cstdlib>
#include <cstring>

#include "dist/mpi_communicator.h"

namespace pollen::dist {

void Communicator::barrier(std::string what) {
  double none = 0;
  all_reduce_sum(std::span<double>(&none, 1), std::move(what));
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
  return std::make_unique<MpiCommunicator>(t, timeout_s);
}

}  // namespace pollen::dist
