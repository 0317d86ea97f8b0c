#include "cli/commands.h"
namespace pollen::cli {
void add_bench_command(CLI::App&) {}
}
