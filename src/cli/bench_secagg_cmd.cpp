// `pollen bench secagg`: bytes and seconds of one securely aggregated round against plain
// aggregation (fed/secagg/bench.h); one JSON line.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "cli/commands.h"
#include "fed/secagg/bench.h"
#include "fed/secagg/graph.h"

namespace pollen::cli {

void add_bench_secagg_command(CLI::App& app) {
  CLI::App* bench = app.get_subcommand("bench");
  auto* cmd = bench->add_subcommand(
      "secagg",
      "One secure-aggregation round (keys, shares, masked inputs, unmasking) of --clients "
      "updates of --params values against plain float32 aggregation; prints bytes per client "
      "and seconds as one JSON line");
  struct Args {
    int64_t clients = 10, params = 1000000, dropouts = 0, neighbours = 0, threshold = 0;
    int ring_bits = 64;
    double dp_clip = 0, dp_noise = 0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--clients", a->clients, "Clients in the round")->capture_default_str();
  cmd->add_option("--params", a->params, "Values per update")->capture_default_str();
  cmd->add_option("--dropouts", a->dropouts, "Clients vanishing after their masked input")
      ->capture_default_str();
  cmd->add_option("--neighbours", a->neighbours, "SecAgg+ neighbours (0: every client)")
      ->capture_default_str();
  cmd->add_option("--threshold", a->threshold, "Shamir threshold (0: a majority of holders)")
      ->capture_default_str();
  cmd->add_option("--ring-bits", a->ring_bits, "32 or 64")->capture_default_str();
  cmd->add_option("--dp-clip", a->dp_clip,
                  "Distributed DP: each client clips its update to this L2 norm and adds its "
                  "share of discrete Gaussian noise (0: off)")
      ->capture_default_str();
  cmd->add_option("--dp-noise", a->dp_noise,
                  "Distributed DP's noise multiplier z (the sum's noise std over --dp-clip)")
      ->capture_default_str();
  cmd->callback([a] {
    fed::secagg::Options o;
    o.enabled = true;
    o.neighbours = a->neighbours;
    o.threshold = a->threshold;
    o.ring_bits = a->ring_bits;
    if (o.ring_bits == 32) o.step = 0x1p-12;  // a 32-bit ring needs a coarser step
    o.validate([](std::string key) {
      std::replace(key.begin(), key.end(), '_', '-');  // the option's spelling
      return "--" + key;
    });
    POLLEN_CHECK(a->dp_clip >= 0 && a->dp_noise >= 0 && (a->dp_clip > 0 || a->dp_noise == 0),
                 "--dp-clip and --dp-noise must be 0 or more, and --dp-noise needs --dp-clip");
    const auto r =
        fed::secagg::bench_round(a->clients, a->params, a->dropouts, o, 1, a->dp_clip, a->dp_noise);
    auto ms = [](double s) { return std::round(s * 1e4) / 10; };
    nlohmann::ordered_json j{
        {"clients", a->clients},
        {"params", a->params},
        {"dropouts", a->dropouts},
        {"neighbours", a->neighbours},
        // each client's neighbours in the graph the round ran on
        {"degree", fed::secagg::graph_degree(static_cast<size_t>(a->clients), a->neighbours)},
        {"ring_bits", a->ring_bits},
        {"dp_clip", a->dp_clip},
        {"dp_noise", a->dp_noise},
        {"plain_bytes_up", r.plain_up},
        {"secure_input_bytes_up", r.secure_input_up},
        {"secure_protocol_bytes_up", r.secure_protocol_up},
        {"secure_protocol_bytes_down", r.secure_protocol_down},
        {"plain_client_ms", ms(r.plain_client_s)},
        {"secure_client_ms", ms(r.secure_client_s)},
        {"plain_server_ms", ms(r.plain_server_s)},
        {"secure_server_ms", ms(r.secure_server_s)}};
    std::printf("%s\n", j.dump().c_str());
  });
}

}  // namespace pollen::cli
