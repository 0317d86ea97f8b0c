#pragma once
// The CPU thread count used by ops: pollen's own pool and OpenBLAS's, set together.
namespace pollen::ops {
void set_cpu_threads(int threads);
}
