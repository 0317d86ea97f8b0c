// `pollen fed privacy`: the epsilon a private federation plan spends, or the noise multiplier a
// target epsilon needs, without a run: central DP under either sampling, or distributed DP's
// discrete Gaussian (fed/secagg/private_quantize.h) as the server charges it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/error.h"
#include "cli/commands.h"
#include "fed/privacy.h"
#include "fed/secagg/private_quantize.h"
#include "fed/secagg/quantize.h"
#include "optim/dp_sgd.h"
#include "optim/privacy_accountant.h"

namespace pollen::cli {

namespace {

struct PrivacyPlan {
  double noise = 0, target_epsilon = 0, rate = 0, delta = 1e-5;
  bool noise_given = false, target_given = false;  // exactly one of the two
  int64_t rounds = 0, every = 0;
  std::string sampling = "fixed";
  // Distributed DP (secure aggregation): the discrete Gaussian's cost.
  int64_t values = 0, clients = 0;
  double clip = 0, step = 0x1p-24;
  std::string rounding = "stochastic";
  bool adaptive_clip = false;
  double clipped_count_stddev = -1;  // sigma_b; -1: clients / 20, as the server's default

  bool distributed() const { return values > 0; }
};

// Distributed DP: the server's own split of noise multiplier z (fed/privacy.h): with adaptive
// clipping, z_Delta on the update and sigma_b on the masked count. Empty when the server would
// refuse the round (the split, or a share the discrete Gaussian or the ring cannot take), with
// why in `refused`.
std::optional<fed::secagg::DistributedNoise> distributed_noise(const PrivacyPlan& p,
                                                               const fed::secagg::Options& o,
                                                               double z, std::string* refused) {
  fed::PrivacyOptions options;
  options.enabled = true;
  options.noise_multiplier = z;
  options.clip = p.clip;
  options.adaptive_clip = p.adaptive_clip;
  options.clipped_count_stddev = p.clipped_count_stddev;
  const fed::CentralDp server(options, 1, /*distributed=*/true);
  *refused = server.refuse_round(1, p.clients, p.clients);
  if (!refused->empty()) {
    // The server's words name its keys; here they are this command's options.
    for (const auto& [key, option] : {std::pair<std::string, std::string>{
                                          "privacy.clipped_count_stddev", "--clipped-count-stddev"},
                                      {"turn adaptive_clip off", "leave out --adaptive-clip"}})
      if (const size_t at = refused->find(key); at != std::string::npos)
        refused->replace(at, key.size(), option);
    return std::nullopt;
  }
  try {
    fed::secagg::check_noise_fits(o, server.distributed_noise(2, p.clients), p.clients,
                                  [](std::string key) {
                                    std::replace(key.begin(), key.end(), '_', '-');
                                    return "--" + key;
                                  });
  } catch (const Error& e) {
    *refused = cat("the server would refuse it: ", e.what());
    return std::nullopt;
  }
  return server.distributed_noise(1, p.clients);  // the whole sum's noise: one input's share
}

void check(const PrivacyPlan& p) {
  POLLEN_CHECK(p.rounds >= 1, "--rounds must be at least 1, got ", p.rounds);
  POLLEN_CHECK(p.every >= 0, "--every must be 0 or more, got ", p.every);
  POLLEN_CHECK(p.noise_given != p.target_given, "give --noise-multiplier or --target-epsilon");
  POLLEN_CHECK(!p.noise_given || (std::isfinite(p.noise) && p.noise >= 0),
               "--noise-multiplier must be 0 or more, got ", p.noise);
  POLLEN_CHECK(!p.target_given || (std::isfinite(p.target_epsilon) && p.target_epsilon > 0),
               "--target-epsilon must be positive and finite, got ", p.target_epsilon);
  POLLEN_CHECK(p.rate > 0 && p.rate <= 1, "--sampling-rate must be in (0, 1], got ", p.rate);
  POLLEN_CHECK(p.delta > 0 && p.delta < 1, "--delta must be in (0, 1), got ", p.delta);
  if (!p.distributed()) return;
  POLLEN_CHECK(p.clip > 0 && p.clients >= 2 && p.rate == 1 && p.sampling == "fixed",
               "distributed DP (--values) needs --clip above 0, --clients of at least 2, "
               "--sampling-rate 1 and --sampling fixed (the server knows whom it selected)");
  POLLEN_CHECK(p.clipped_count_stddev == -1 || p.clipped_count_stddev > 0,
               "--clipped-count-stddev must be positive (or -1: clients / 20), got ",
               p.clipped_count_stddev);
}

// Epsilon at delta after `rounds` rounds of noise multiplier z (infinite where the server would
// refuse it). R rounds at one rate and noise compose to R times one round's RDP (as Opacus
// computes it): each is one product.
optim::Epsilon epsilon_after(const PrivacyPlan& p, const fed::secagg::Options& o, double z,
                             int64_t rounds) {
  if (!p.distributed()) {
    return fed::after_central_releases(fed::PrivacyAccountant(), p.sampling, p.rate, z, rounds)
        .epsilon(p.delta);
  }
  std::string refused;
  const auto central = distributed_noise(p, o, z, &refused);
  if (!central) return {INFINITY, 0};
  std::vector<double> rdp = fed::secagg::release_rdp(o, *central, p.values, p.clients);
  for (double& v : rdp) v *= static_cast<double>(rounds);
  return optim::rdp_to_epsilon(rdp, p.delta);
}

void run(PrivacyPlan& p) {
  check(p);
  fed::secagg::Options o;
  if (p.distributed()) {
    o.step = p.step;
    o.stochastic = p.rounding == "stochastic";
    o.validate([](std::string key) { return "--" + key; });
    if (p.noise_given) {
      std::string refused;
      POLLEN_CHECK(distributed_noise(p, o, p.noise, &refused).has_value(), "--noise-multiplier ",
                   p.noise, ": ", refused);
    }
  }
  if (p.target_given) {
    // Where the server would refuse z (epsilon_after is infinite there), no larger z is taken.
    p.noise = optim::smallest_noise_multiplier(
        [&](double z) { return epsilon_after(p, o, z, p.rounds).epsilon; }, p.target_epsilon,
        [&] {
          return cat(
              "--target-epsilon ", p.target_epsilon, " at delta ", p.delta,
              " cannot be reached in ", p.rounds, " rounds with any noise multiplier ",
              p.distributed()
                  ? cat("the server would take (each client's share within 2^28 steps of "
                        "--step ",
                        p.step, p.adaptive_clip ? ", and z below the count's noise" : "",
                        "); raise --step", p.adaptive_clip ? " or --clipped-count-stddev" : "",
                        ", ask for a larger epsilon or fewer rounds")
                  : std::string("up to 1024; ask for a larger epsilon, fewer rounds or a "
                                "lower sampling rate"));
        });
  }
  std::printf("%-8s %-12s %s\n", "rounds", "epsilon", "best RDP order");
  auto print_after = [&](int64_t r) {
    const optim::Epsilon e = epsilon_after(p, o, p.noise, r);
    std::printf("%-8lld %-12.6g %g\n", static_cast<long long>(r), e.epsilon, e.order);
  };
  if (p.every > 0)
    for (int64_t r = p.every; r < p.rounds; r += p.every) print_after(r);
  print_after(p.rounds);
  // Nine digits: a calibrated z copied into a config must not round below what was found.
  std::printf("noise multiplier %.9g%s, sampling rate %g (%s), delta %g\n", p.noise,
              p.target_given ? cat(" (for epsilon ", p.target_epsilon, ")").c_str() : "", p.rate,
              p.sampling.c_str(), p.delta);
  if (p.distributed()) {
    std::printf(
        "distributed discrete Gaussian: %lld values, clip %g, step %g (%s), up to %lld clients\n",
        static_cast<long long>(p.values), p.clip, p.step, p.rounding.c_str(),
        static_cast<long long>(p.clients));
  }
}

}  // namespace

void add_fed_privacy_command(CLI::App& app) {
  CLI::App* fed = app.get_subcommand("fed");
  auto p = std::make_shared<PrivacyPlan>();
  auto* privacy = fed->add_subcommand(
      "privacy",
      "Epsilon of central or distributed DP after some rounds, or the noise multiplier a target "
      "epsilon needs, for planning (RDP accountant)");
  auto* noise = privacy->add_option("--noise-multiplier", p->noise, "z: noise std / clip norm");
  auto* target =
      privacy
          ->add_option("--target-epsilon", p->target_epsilon,
                       "Instead of --noise-multiplier: the smallest z (to 0.1%) whose epsilon "
                       "after --rounds is at most this")
          ->excludes(noise);
  privacy
      ->add_option("--sampling-rate", p->rate,
                   "q: share of the clients selected per round (1 with secure aggregation, whose "
                   "server knows the sample; --values accounts its discrete Gaussian)")
      ->required();
  privacy->add_option("--rounds", p->rounds, "Rounds")->required();
  privacy->add_option("--delta", p->delta, "delta")->capture_default_str();
  privacy->add_option("--every", p->every, "Also print epsilon every this many rounds");
  privacy
      ->add_option(
          "--sampling", p->sampling,
          "privacy.sampling: fixed (a sample without replacement, accounted with "
          "multiplier z / 2 below rate 1, or as every client selected where that is tighter) or "
          "poisson")
      ->check(CLI::IsMember({"fixed", "poisson"}))
      ->capture_default_str();
  auto* values =
      privacy
          ->add_option(
              "--values", p->values,
              "Distributed DP under secure aggregation: the values each update holds (the model's "
              "parameters); with --clip and --clients, the clients' discrete Gaussian is accounted "
              "instead of the Gaussian")
          ->check(one_or_more());
  privacy->add_option("--clip", p->clip, "Distributed DP: privacy.clip, the L2 norm C")
      ->needs(values);
  privacy->add_option("--clients", p->clients, "Distributed DP: the clients selected per round")
      ->needs(values);
  privacy->add_option("--step", p->step, "Distributed DP: secure_aggregation.step")
      ->needs(values)
      ->capture_default_str();
  privacy->add_option("--rounding", p->rounding, "Distributed DP: secure_aggregation.rounding")
      ->needs(values)
      ->check(CLI::IsMember({"stochastic", "nearest"}))
      ->capture_default_str();
  auto* adaptive =
      privacy
          ->add_flag("--adaptive-clip", p->adaptive_clip,
                     "Distributed DP: privacy.adaptive_clip, z split between the update and the "
                     "masked count of unclipped updates as the server splits it")
          ->needs(values);
  privacy
      ->add_option("--clipped-count-stddev", p->clipped_count_stddev,
                   "Distributed DP with --adaptive-clip: privacy.clipped_count_stddev (-1: "
                   "clients / 20)")
      ->needs(adaptive)
      ->capture_default_str();
  privacy->callback([p, noise, target] {
    p->noise_given = noise->count() > 0;
    p->target_given = target->count() > 0;
    run(*p);
  });
}

}  // namespace pollen::cli
