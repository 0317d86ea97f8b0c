// `pollen plot RUN_DIR... --output curves.svg`: wiring only; the drawing is obs::plot_svg.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"
#include "cli/commands.h"
#include "obs/plot.h"

namespace pollen::cli {

void add_plot_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plot",
      "Draw train and validation loss and the learning rate of one or more runs against "
      "tokens, as an SVG (reads RUN_DIR/metrics.jsonl)");
  auto runs = std::make_shared<std::vector<std::string>>();
  auto output = std::make_shared<std::string>("curves.svg");
  cmd->add_option("runs", *runs, "Run folders (run.dir of pollen train) or metrics.jsonl files")
      ->required();
  cmd->add_option("--output,-o", *output, "SVG file to write")->capture_default_str();
  cmd->callback([runs, output] {
    std::vector<obs::RunCurves> curves;
    std::vector<std::filesystem::path> drawn;
    for (const auto& r : *runs) {
      obs::RunCurves c = obs::read_run_curves(r);
      // Beside others, a run that has only just started is left out rather than failing all.
      POLLEN_CHECK(c.has_loss() || runs->size() > 1, "'", c.file.string(),
                   "' holds no loss records");
      if (!c.has_loss()) {
        log::warn("'", c.file.string(), "' holds no loss records yet: left out of the plot");
        continue;
      }
      curves.push_back(std::move(c));
      drawn.push_back(r);
    }
    POLLEN_CHECK(!curves.empty(), "none of the ", runs->size(), " runs holds loss records yet");
    obs::name_runs_apart(curves, drawn);
    write_file_atomic(*output, obs::plot_svg(curves));
    log::info("wrote ", *output, " (", curves.size(), " run", curves.size() == 1 ? "" : "s", ")");
  });
}

}  // namespace pollen::cli
