#pragma once
// The optimizer of a post-training run: AdamW over the trained parameters, whose state every rank
// holds whole, or with parallel.zero = 1 and several ranks dist::ZeroAdamW (ZeRO-1), each rank
// keeping its blocks of the moments alone. With several ranks it owns the dist::GradReducer that
// sums the gradients over them. Either way a checkpoint holds the whole moments, so that a run
// resumes at any world size and either setting.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "dist/zero_adamw.h"
#include "optim/adamw.h"
#include "train/post_config.h"
#include "train/trainer_checkpoint.h"

namespace pollen::train {

class PostOptimizer {
 public:
  // AdamW over `trained` (named, in the optimizer's order) as the run file's [optimizer] and
  // [parallel] set it, reducing over `comm` when it holds several ranks.
  PostOptimizer(const PostConfig& cfg, const std::vector<std::pair<std::string, ag::Var>>& trained,
                dist::Communicator& comm);

  // The reducer an objective splits its steps with (Objective::split_across); null alone.
  dist::GradReducer* reducer() { return reducer_.get(); }
  bool sharded() const { return zero_ != nullptr; }

  // One update at `lr` after the step's gradients; returns their norm before clipping (a
  // non-finite norm leaves the weights alone).
  double step(double lr);
  // Bytes of AdamW's state this rank holds.
  int64_t state_bytes() const;

  // The whole moments as a checkpoint holds them. Sharded, a collective that every rank calls,
  // whose result only a rank that passes `keep` holds.
  OptimizerMoments moments(bool keep);
  // The moments and step count of a checkpoint folder; sharded, each rank keeps its blocks.
  void load(const std::filesystem::path& dir);

 private:
  std::vector<std::pair<std::string, ag::Var>> trained_;
  std::unique_ptr<dist::GradReducer> reducer_;
  std::unique_ptr<dist::ZeroAdamW> zero_;  // parallel.zero = 1 with several ranks
  std::optional<optim::AdamW> adamw_;      // else
};

}  // namespace pollen::train
