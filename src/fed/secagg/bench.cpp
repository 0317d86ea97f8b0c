#include "fed/secagg/bench.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "base/error.h"
#include "base/rng.h"
#include "fed/compress.h"
#include "fed/robust.h"
#include "fed/secagg/graph.h"
#include "fed/secagg/private_quantize.h"
#include "fed/secagg/quantize.h"
#include "fed/secagg/session.h"

namespace pollen::fed::secagg {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

BenchResult bench_round(int64_t clients, int64_t params, int64_t dropouts,
                        const Options& plain_options, uint64_t seed, double dp_clip,
                        double dp_noise) {
  POLLEN_CHECK(clients >= 2 && params >= 1 && dropouts >= 0 && dropouts < clients,
               "bench secagg: 2 or more clients, 1 or more params, fewer dropouts than clients");
  // Each client's shares go to its holders (its neighbours and itself); the threshold of them
  // must exist, and with every client a neighbour, survive the dropouts.
  const auto holders =
      static_cast<int64_t>(graph_degree(static_cast<size_t>(clients), plain_options.neighbours)) +
      1;
  const auto threshold = static_cast<int64_t>(plain_options.resolved_threshold(holders));
  // Distributed DP: every client's weight is 1 and its noise share z C / sqrt(threshold).
  Options options = plain_options;
  options.noise.clip = dp_clip;
  options.noise.stddev = dp_noise * dp_clip / std::sqrt(static_cast<double>(threshold));
  const bool private_ = options.noise.enabled();
  if (private_) check_fits(clients, options);
  POLLEN_CHECK(threshold <= holders, "bench secagg: --threshold ", threshold, " exceeds the ",
               holders, " holders of each client's shares (its --neighbours and itself)");
  POLLEN_CHECK(options.neighbours > 0 || clients - dropouts >= threshold,
               "bench secagg: ", dropouts, " --dropouts of ", clients, " clients leave ",
               clients - dropouts, " holders of each client's shares, fewer than the threshold ",
               threshold);
  const auto n = static_cast<size_t>(clients);
  Rng rng(seed);
  std::vector<Weights> deltas(n);
  std::vector<ClientUpdate> updates(n);
  for (size_t i = 0; i < n; ++i) {
    Tensor t = Tensor::empty({params}, DType::f32);
    for (int64_t j = 0; j < params; ++j)
      t.data<float>()[j] = static_cast<float>(rng.normal() * 1e-3);
    deltas[i] = {t};
    updates[i] = {cat("client-", i), 1000 + static_cast<int64_t>(i), {}, {}, {}, {}};
  }
  BenchResult r;

  // Plain: each client encodes float32, the server decodes all and averages.
  CompressOptions none;
  std::vector<std::string> wire(n);
  auto t0 = Clock::now();
  for (size_t i = 0; i < n; ++i) encode(deltas[i][0].data<float>(), params, none, wire[i]);
  r.plain_client_s = since(t0) / static_cast<double>(n);
  r.plain_up = wire[0].size();
  t0 = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    Tensor t = Tensor::empty({params}, DType::f32);
    decode(reinterpret_cast<const uint8_t*>(wire[i].data()), wire[i].size(), params, none,
           t.data<float>(), "bench");
    updates[i].delta = {t};
  }
  Strategy::weighted_delta(deltas[0], updates);
  r.plain_server_s = since(t0);

  // Secure: the four phases, timing each side.
  std::vector<std::string> ids;
  for (const auto& u : updates) ids.push_back(u.client_id);
  ServerSession server(1, ids, options, seed, params);
  std::vector<ClientSession> sessions;
  for (const auto& id : ids) sessions.emplace_back(id, 1);
  double client_s = 0, server_s = 0;
  uint64_t up = 0, down = 0;
  auto client = [&](auto f) {
    const auto c0 = Clock::now();
    f();
    client_s += since(c0);
  };
  auto serve = [&](auto f) {
    const auto s0 = Clock::now();
    f();
    server_s += since(s0);
  };
  for (size_t i = 0; i < n; ++i) {
    pb::SecAggKeys k;
    client([&] { k = sessions[i].advertise(); });
    up += k.ByteSizeLong();
    serve([&] { server.advertise(ids[i], k); });
  }
  serve([&] { server.close_phase(); });
  for (size_t i = 0; i < n; ++i) {
    pb::SecAggRoster roster;
    serve([&] { roster = server.roster(ids[i]); });
    pb::SecAggShares shares;
    client([&] { shares = sessions[i].share(roster); });
    down += roster.ByteSizeLong();
    up += shares.ByteSizeLong();
    serve([&] { server.shares(ids[i], shares); });
  }
  serve([&] { server.close_phase(); });
  const size_t word = static_cast<size_t>(options.ring_bits) / 8;
  for (size_t i = 0; i < n; ++i) {
    pb::SecAggInbox box;
    serve([&] { box = server.inbox(ids[i]); });
    down += box.ByteSizeLong();
    std::string bytes;
    client([&] {
      std::vector<uint64_t> x;
      if (private_) {
        Weights clipped = clone_weights(deltas[i]);
        clip_to_norm(clipped, l2_norm(clipped), dp_clip);
        x = quantize_private(clipped, dp_clip, options.noise.stddev, options, seed + i,
                             Rng(seed).fork(i));
      } else {
        x = quantize(deltas[i], updates[i].tokens, options, seed + i);
      }
      sessions[i].mask(box, x);
      bytes.resize(x.size() * word);
      for (size_t j = 0; j < x.size(); ++j) std::memcpy(bytes.data() + j * word, &x[j], word);
    });
    r.secure_input_up = bytes.size();
    serve([&] { server.add_input(ids[i], bytes); });
  }
  serve([&] { server.close_phase(); });
  for (size_t i = static_cast<size_t>(dropouts); i < n; ++i) {
    pb::SecAggSurvivors list;
    serve([&] { list = server.survivors(ids[i]); });
    pb::SecAggReveal reveal;
    client([&] { reveal = sessions[i].reveal(list); });
    down += list.ByteSizeLong();
    up += reveal.ByteSizeLong();
    serve([&] { server.reveal(ids[i], reveal); });
  }
  serve([&] {
    server.close_phase();
    int64_t tokens = 0;
    for (const auto& u : updates) tokens += u.tokens;
    const int64_t weights = private_ ? clients : tokens;
    dequantize(server.unmasked_sum(), weights, static_cast<double>(weights), options, deltas[0]);
  });
  r.secure_client_s = client_s / static_cast<double>(n);
  r.secure_server_s = server_s;
  r.secure_protocol_up = up / n;
  r.secure_protocol_down = down / n;
  return r;
}

}  // namespace pollen::fed::secagg
