// train.round_warmup_steps of a client: every round's first steps ramp the inner learning rate
// up again, step s (from 0) of a round taking (s + 1) / round_warmup_steps of it.
#include <gtest/gtest.h>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/fixtures.h"
#include "fed/wire.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

TEST(RoundWarmup, EachRoundsFirstStepsTakeTheRampedRate) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("round_warmup");
  ClientConfig c = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 1, 1).clients[0];
  const Weights start = model_weights(model::Llama(c.model, 9));
  // Rounds of one step each. With round_warmup_steps = 2 every round's only step is its step
  // 0, at half the rate: the same as a client whose rate is halved (3e-3 / 2 is exact).
  auto trained = [&](double lr, int64_t round_warmup, std::vector<int64_t> rounds) {
    ClientConfig cc = c;
    cc.train.optimizer.lr = lr;
    cc.train.round_warmup_steps = round_warmup;
    LocalTrainer t(cc);
    set_model_weights(t.model(), start);
    for (int64_t steps : rounds) t.train(steps);
    return model_weights(t.model());
  };
  const Weights half = trained(1.5e-3, 0, {1, 1});
  EXPECT_TRUE(bitwise_equal(trained(3e-3, 2, {1, 1}), half));
  // One round of two steps: the second takes the full rate, so it differs.
  EXPECT_FALSE(bitwise_equal(trained(3e-3, 2, {2}), half));
  // And without the ramp both steps take the full rate.
  EXPECT_FALSE(bitwise_equal(trained(3e-3, 0, {1, 1}), half));
  std::filesystem::remove_all(dir);
}
