// dist/nccl.h in a build without NCCL: every call refuses, naming what is missing.
#include "base/error.h"
#include "dist/nccl.h"

namespace pollen::dist::nccl {
namespace {

[[noreturn]] void missing() {
  fail(
      "data parallelism on GPUs needs NCCL: this pollen was built without it (CMake looks for "
      "nccl.h beside the CUDA toolkit; docs/parallel.md)");
}

}  // namespace

bool built() {
  return false;
}
UniqueId make_unique_id() {
  missing();
}
Comm* init(const UniqueId&, int, int) {
  missing();
}
void destroy(Comm*) {}
void abort(Comm*) {}
void all_reduce_sum(Comm*, float*, int64_t) {
  missing();
}
void reduce_scatter_sum(Comm*, const float*, float*, int64_t) {
  missing();
}
void all_gather(Comm*, const float*, float*, int64_t) {
  missing();
}
void broadcast(Comm*, float*, int64_t, int) {
  missing();
}
Event* record(Comm*) {
  missing();
}
bool done(Event*) {
  missing();
}
void destroy(Event*) {}
std::string async_error(Comm*) {
  return "";
}

}  // namespace pollen::dist::nccl
