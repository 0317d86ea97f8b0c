// What the tape keeps alive between forward and backward: the tensors its backward steps read,
// not every op's output (measured on the host allocator's bytes in use).
#include "autograd/tape.h"

#include <gtest/gtest.h>

#include "autograd/functions.h"
#include "support/gradcheck.h"
#include "tensor/allocator.h"

namespace pollen {
namespace {
using testing::random_tensor;

constexpr int64_t kRows = 256, kC = 64;

size_t in_use() {
  return CpuAllocator::instance().stats().in_use_bytes;
}

// One (kRows, kC) float64 activation, as the allocator hands it out.
size_t activation_bytes() {
  return CpuAllocator::size_class(kRows * kC * sizeof(double));
}

TEST(Tape, GivesBackAnOutputThatNoBackwardStepReads) {
  Rng rng(1);
  ag::Var x(random_tensor({kRows, kC}, rng), true, "x"), w(random_tensor({kC, kC}, rng), true, "w");
  ag::Tape tape;
  ag::Var z;
  const size_t before = in_use();
  {
    ag::TapeScope scope(tape);
    // z = x + x w^T: the linear's backward reads x and w, the add's reads nothing.
    z = ag::add(x, ag::linear(x, w));
  }
  EXPECT_EQ(in_use() - before, activation_bytes());  // z alone: x w^T was given back

  // The gradients still flow through the released output: with dz = 1,
  // dx[i][k] = 1 + sum_m w[m][k] and dw[m][k] = sum_i x[i][k].
  tape.backward(z, Tensor::full({kRows, kC}, 1.0, DType::f64));
  const double* xp = x.value().data<double>();
  const double* wp = w.value().data<double>();
  for (int64_t k = 0; k < kC; ++k) {
    double col_w = 0, col_x = 0;
    for (int64_t m = 0; m < kC; ++m) col_w += wp[m * kC + k];
    for (int64_t i = 0; i < kRows; ++i) col_x += xp[i * kC + k];
    for (int64_t i = 0; i < kRows; i += 51)
      EXPECT_NEAR(x.grad().data<double>()[i * kC + k], 1 + col_w, 1e-12) << i << "," << k;
    for (int64_t m = 0; m < kC; m += 13)
      EXPECT_NEAR(w.grad().data<double>()[m * kC + k], col_x, 1e-9) << m << "," << k;
  }
}

TEST(Tape, KeepsTheOutputsABackwardStepReads) {
  Rng rng(2);
  ag::Var x(random_tensor({kRows, kC}, rng), true, "x");
  ag::Var wg(random_tensor({kC, kC}, rng), true, "wg"),
      wu(random_tensor({kC, kC}, rng), true, "wu");
  ag::Tape tape;
  ag::Var s;
  const size_t before = in_use();
  {
    ag::TapeScope scope(tape);
    // swiglu's backward reads both of its inputs: they stay after the forward drops them.
    s = ag::swiglu(ag::linear(x, wg), ag::linear(x, wu));
  }
  EXPECT_EQ(in_use() - before, 3 * activation_bytes());
  tape.backward(s, Tensor::full({kRows, kC}, 1.0, DType::f64));
  EXPECT_TRUE(wg.grad().defined());
  EXPECT_TRUE(wu.grad().defined());
  s = ag::Var();
  // All that is left: the gradients of x, wg and wu.
  EXPECT_EQ(in_use() - before,
            activation_bytes() + 2 * CpuAllocator::size_class(kC * kC * sizeof(double)));
}

}  // namespace
}  // namespace pollen
