// `pollen plot RUN_DIR... --output curves.svg`: wiring only; the drawing is obs::plot_svg.
#include <memory>
#include <string>
#include <vector>

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
    for (const auto& r : *runs) curves.push_back(obs::read_run_curves(r));
    obs::name_runs_apart(curves, {runs->begin(), runs->end()});
    write_file_atomic(*output, obs::plot_svg(curves));
    log::info("wrote ", *output, " (", curves.size(), " run", curves.size() == 1 ? "" : "s", ")");
  });
}

}  // namespace pollen::cli
