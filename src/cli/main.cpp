// pollen: one binary, many subcommands. Parsing and wiring only.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "base/error.h"
#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{
      "pollen: build language models across data silos.\n"
      "Curate data, pre-train and post-train Llama-family models, alone or federated, on CPU "
      "or GPU.",
      "pollen"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  pollen::cli::add_version_command(app);
  pollen::cli::add_bench_command(app);
  pollen::cli::add_bench_checkpoint_command(app);
  pollen::cli::add_bench_secagg_command(app);
  pollen::cli::add_train_command(app);
  pollen::cli::add_plot_command(app);
  pollen::cli::add_tokenizer_command(app);
  pollen::cli::add_data_command(app);
  pollen::cli::add_fed_command(app);
  pollen::cli::add_fed_post_command(app);
  pollen::cli::add_fed_privacy_command(app);
  pollen::cli::add_export_command(app);
  pollen::cli::add_generate_command(app);
  pollen::cli::add_eval_command(app);
  pollen::cli::add_score_command(app);
  pollen::cli::add_launch_command(app);
  pollen::cli::add_chat_command(app);
  pollen::cli::add_serve_command(app);
  pollen::cli::add_sft_command(app);
  pollen::cli::add_dpo_command(app);
  pollen::cli::add_rm_command(app);
  pollen::cli::add_grpo_command(app);
  app.parse_complete_callback([&app] { pollen::cli::refuse_ranks_unless_supported(app); });
  try {
    app.parse(argc, argv);
  } catch (const CLI::RequiredError& e) {
    // CLI11 checks required options before unknown ones, so a mistyped --config read as a
    // missing one: name the argument that was not understood first.
    // A command that passes the rest on (launch -- train ...) has no unknown arguments.
    const std::function<bool(const CLI::App*)> passes_on = [&](const CLI::App* a) {
      if (a->get_prefix_command()) return true;
      for (const CLI::App* sub : a->get_subcommands())
        if (passes_on(sub)) return true;
      return false;
    };
    const std::vector<std::string> extras = app.remaining(true);
    if (!extras.empty() && !passes_on(&app))
      app.exit(CLI::ExtrasError(extras));
    else
      app.exit(e);
    return 2;
  } catch (const CLI::ParseError& e) {
    // --help and --version end here with 0; every bad command line exits 2, as the help says.
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const pollen::Error& e) {
    std::fprintf(stderr, "pollen: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pollen: error: %s\n", e.what());
    return 1;
  }
  // What a command printed must have reached stdout: results redirected to a full disk would
  // otherwise be lost with exit code 0.
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "pollen: error: cannot write to standard output: %s\n",
                 std::strerror(errno));
    return 1;
  }
  return pollen::cli::exit_code_slot();
}
