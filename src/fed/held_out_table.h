#pragma once
// The table `pollen fed simulate` and `pollen fed post` print after their last round: each silo's
// held-out loss of the final global model (and the objective's headline metric when it has one).
#include <string>

#include "fed/run.h"

namespace pollen::fed {

// loss_header names the loss column. A silo without held-out data shows "-", with a line saying
// why. A run stopped by a signal has no final evaluation: the table is empty.
std::string held_out_table(const SimulationResult& r, const std::string& loss_header);

}  // namespace pollen::fed
