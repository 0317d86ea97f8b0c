#pragma once
// Training curves as SVG: train and validation loss (top) and learning rate (bottom) against
// tokens, one colour per run, read from each run folder's metrics.jsonl, with the checkpoint
// evaluations of `pollen eval --run` (eval.jsonl) when the folder has them.
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace pollen::obs {

struct Curve {
  std::vector<double> x, y;
};

struct RunCurves {
  std::string name;
  std::filesystem::path file;  // the metrics.jsonl read
  Curve train_loss, val_loss, lr;
  std::vector<std::pair<std::string, Curve>> checkpoint_loss;  // per dataset, from eval.jsonl
  bool has_loss() const { return !train_loss.x.empty() || !val_loss.x.empty(); }
};

// Reads <run_dir>/metrics.jsonl (or a .jsonl file itself); errors name the file and line. A run
// that has written no loss yet reads with no points (has_loss() false).
RunCurves read_run_curves(const std::filesystem::path& run);

// Runs whose folders share a name (silo-a/run, silo-b/run) are named by as many folders above
// as tell them apart (`runs`: the paths read_run_curves was given, in the order of `curves`).
void name_runs_apart(std::vector<RunCurves>& curves,
                     const std::vector<std::filesystem::path>& runs);

std::string plot_svg(const std::vector<RunCurves>& runs);

}  // namespace pollen::obs
