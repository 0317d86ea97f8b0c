// ops::OpProfile: which ops it times and how it counts them (on the CPU).
#include "ops/profile.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"

namespace pollen {
namespace {

Tensor filled(const Shape& shape, double value) {
  Tensor t = Tensor::empty(shape, DType::f32);
  t.fill_(value);
  return t;
}

const ops::OpProfile::Entry* find(const std::vector<ops::OpProfile::Entry>& entries,
                                  const std::string& op) {
  for (const auto& e : entries)
    if (e.op == op) return &e;
  return nullptr;
}

TEST(OpProfile, CountsEachOpByNameAndTheOuterOpOnlyWhenNested) {
  const Tensor a = filled({96, 96}, 0.5), b = filled({96, 96}, 2.0);
  Tensor c = filled({96, 96}, 0);
  ops::gemm(a, false, b, false, c, 1.0, 0.0);  // before any profile: not counted
  ops::OpProfile profile;
  ops::gemm(a, false, b, false, c, 1.0, 0.0);
  ops::gemm(a, false, b, false, c, 1.0, 0.0);
  ops::add(a, b, c);
  {
    const ops::OpTimer outer("outer", a);  // an op built from other ops counts once, as itself
    ops::gemm(a, false, b, false, c, 1.0, 0.0);
    ops::add(a, b, c);
  }
  const auto entries = profile.entries();
  ASSERT_EQ(entries.size(), 3u);
  ASSERT_NE(find(entries, "gemm"), nullptr);
  EXPECT_EQ(find(entries, "gemm")->calls, 2);
  EXPECT_GT(find(entries, "gemm")->ms, 0);
  ASSERT_NE(find(entries, "add"), nullptr);
  EXPECT_EQ(find(entries, "add")->calls, 1);
  ASSERT_NE(find(entries, "outer"), nullptr);
  EXPECT_EQ(find(entries, "outer")->calls, 1);
  for (size_t i = 1; i < entries.size(); ++i) EXPECT_GE(entries[i - 1].ms, entries[i].ms);
  EXPECT_EQ(c.data<float>()[0], 2.5f);  // the ops still did their work

  profile.reset();
  EXPECT_TRUE(profile.entries().empty());
  ops::add(a, b, c);
  EXPECT_EQ(profile.entries().size(), 1u);
}

TEST(OpProfile, OnePerThreadAndNothingCountedOnceItEnds) {
  const Tensor a = filled({4}, 1.0), b = filled({4}, 1.0);
  Tensor c = filled({4}, 0);
  {
    ops::OpProfile profile;
    EXPECT_THROW(ops::OpProfile second, Error);
  }
  ops::add(a, b, c);     // no profile active: nothing to count into, nothing fails
  ops::OpProfile again;  // the first one ended, so another may start
  EXPECT_TRUE(again.entries().empty());
}

}  // namespace
}  // namespace pollen
