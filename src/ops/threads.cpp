#include "ops/threads.h"

#include <cblas.h>

#include "base/thread_pool.h"

namespace pollen::ops {

void set_cpu_threads(int threads) {
  set_num_threads(threads);
  openblas_set_num_threads(threads);
}

}  // namespace pollen::ops
