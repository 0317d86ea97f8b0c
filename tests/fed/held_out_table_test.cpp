// The table fed simulate and fed post print: a silo without held-out data shows "-", not nan.
#include "fed/held_out_table.h"

#include <gtest/gtest.h>

#include <cmath>

using namespace pollen;

TEST(HeldOutTable, ASiloWithoutHeldOutDataShowsADashAndWhy) {
  fed::SimulationResult r;
  r.clients = {"silo-a", "silo-without-held-out-data-and-a-long-name"};
  r.eval_loss = {2.5, std::nan("")};
  EXPECT_EQ(fed::held_out_table(r, "held-out loss"),
            "silo                     held-out loss\n"
            "silo-a                   2.5000\n"
            "silo-without-held-out-data-and-a-long-name -\n"
            "-: the silo has no held-out data\n");
  r.headline = "reward";
  r.eval_headline = {0.75, std::nan("")};
  r.eval_loss = {-0.75, 1.125};
  EXPECT_EQ(fed::held_out_table(r, "held-out loss"),
            "silo                     held-out loss  held-out reward\n"
            "silo-a                   -0.7500        0.7500\n"
            "silo-without-held-out-data-and-a-long-name 1.1250         -\n");
  r.clients.clear();  // stopped by a signal: no final evaluation
  EXPECT_EQ(fed::held_out_table(r, "held-out loss"), "");
}
