// Secure aggregation's parts and protocol without a model: Shamir sharing and its threshold,
// the cryptography, the masking graph, quantisation and its error bound, and whole rounds of
// ClientSession / ServerSession with and without dropouts, checked exactly in the ring.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "base/log.h"
#include "base/rng.h"
#include "fed/secagg/crypto.h"
#include "fed/secagg/graph.h"
#include "fed/secagg/quantize.h"
#include "fed/secagg/session.h"
#include "fed/secagg/shamir.h"
#include "support/errors.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::secagg;

namespace {

struct Quiet {
  Quiet() { log::set_level(log::Level::error); }
  ~Quiet() { log::set_level(log::Level::info); }
};

// Pearson's chi-square statistic of the bytes of `words` (ring_bits / 8 bytes each) against
// the uniform distribution over 256 values (255 degrees of freedom: mean 255, sd 22.6).
double byte_chi_square(const std::vector<uint64_t>& words, int ring_bits) {
  std::array<double, 256> count{};
  double n = 0;
  for (uint64_t w : words) {
    for (int b = 0; b < ring_bits / 8; ++b, ++n) count[(w >> (8 * b)) & 0xff] += 1;
  }
  const double expected = n / 256;
  double chi = 0;
  for (double c : count) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

Key32 key_of(uint8_t start) {
  Key32 k;
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(start + 37 * i);
  return k;
}

// One round of the protocol among `inputs.size()` clients named c00, c01, ... `drop_before_share`
// advertise keys and vanish; `drop_before_input` share keys but send no masked input;
// `drop_before_reveal` send their input, then vanish.
struct RoundResult {
  ServerSession::Phase phase;
  std::string failure;
  std::vector<uint64_t> sum;                  // unmasked, when done
  std::vector<std::vector<uint64_t>> masked;  // what each input sender sent
  std::vector<std::string> senders;
  bool unmask_opened = false;  // the input phase closed into the unmask phase
};

RoundResult run_round(const std::vector<std::vector<uint64_t>>& inputs, const Options& options,
                      const std::set<size_t>& drop_before_input,
                      const std::set<size_t>& drop_before_reveal,
                      const std::set<size_t>& drop_before_share = {}) {
  const size_t n = inputs.size();
  std::vector<std::string> ids;
  for (size_t i = 0; i < n; ++i) ids.push_back(cat("c", i < 10 ? "0" : "", i));
  const int64_t round = 3;
  ServerSession server(round, ids, options, 77, static_cast<int64_t>(inputs[0].size()));
  std::vector<ClientSession> clients;
  for (const auto& id : ids) clients.emplace_back(id, round);
  for (size_t i = 0; i < n; ++i) server.advertise(ids[i], clients[i].advertise());
  EXPECT_TRUE(server.phase_complete());
  server.close_phase();
  RoundResult r;
  if (server.phase() == ServerSession::Phase::failed) return {server.phase(), server.failure()};
  for (size_t i = 0; i < n; ++i) {
    if (!drop_before_share.count(i)) server.shares(ids[i], clients[i].share(server.roster(ids[i])));
  }
  server.close_phase();
  if (server.phase() == ServerSession::Phase::failed) return {server.phase(), server.failure()};
  for (size_t i = 0; i < n; ++i) {
    if (drop_before_input.count(i) || drop_before_share.count(i)) continue;
    std::vector<uint64_t> x = inputs[i];
    clients[i].mask(server.inbox(ids[i]), x);
    std::string bytes(x.size() * options.ring_bits / 8, '\0');
    for (size_t j = 0; j < x.size(); ++j) {
      std::memcpy(bytes.data() + j * options.ring_bits / 8, &x[j], options.ring_bits / 8);
    }
    server.add_input(ids[i], bytes);
    r.masked.push_back(x);
    r.senders.push_back(ids[i]);
  }
  server.close_phase();
  if (server.phase() == ServerSession::Phase::failed) return {server.phase(), server.failure()};
  r.unmask_opened = true;
  for (size_t i = 0; i < n; ++i) {
    if (drop_before_input.count(i) || drop_before_reveal.count(i) || drop_before_share.count(i)) {
      continue;
    }
    server.reveal(ids[i], clients[i].reveal(server.survivors(ids[i])));
  }
  server.close_phase();
  r.phase = server.phase();
  r.failure = server.failure();
  if (r.phase == ServerSession::Phase::done) r.sum = server.unmasked_sum();
  return r;
}

std::vector<std::vector<uint64_t>> random_inputs(size_t n, size_t m, int ring_bits, uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<uint64_t>> out(n, std::vector<uint64_t>(m));
  for (auto& v : out) {
    for (auto& w : v) w = rng.next_u64() & ring_mask(ring_bits);
  }
  return out;
}

std::vector<uint64_t> plain_sum(const std::vector<std::vector<uint64_t>>& inputs,
                                const std::set<size_t>& leave_out, int ring_bits) {
  std::vector<uint64_t> s(inputs[0].size(), 0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (leave_out.count(i)) continue;
    for (size_t j = 0; j < s.size(); ++j) s[j] = (s[j] + inputs[i][j]) & ring_mask(ring_bits);
  }
  return s;
}

}  // namespace

// ---- Shamir -----------------------------------------------------------------------------------

TEST(Shamir, AnyThresholdSubsetRebuildsTheSecretAndFewerDoNot) {
  const Key32 secret = key_of(11);
  const std::vector<uint32_t> xs{3, 7, 8, 20, 21};
  const auto shares = share_secret(secret, 3, xs);
  ASSERT_EQ(shares.size(), 5u);
  // Every 3-subset gives the secret back.
  for (size_t a = 0; a < 5; ++a) {
    for (size_t b = a + 1; b < 5; ++b) {
      for (size_t c = b + 1; c < 5; ++c) {
        EXPECT_EQ(reconstruct_secret({shares[a], shares[b], shares[c]}, 3, "test"), secret);
      }
    }
  }
  // Two shares are not enough: refused at threshold 3, and interpolating them as if the
  // threshold were 2 gives another value.
  EXPECT_THROW(reconstruct_secret({shares[0], shares[1]}, 3, "test"), Error);
  bool differs = false;
  try {
    differs = reconstruct_secret({shares[0], shares[1]}, 2, "test") != secret;
  } catch (const Error&) {
    differs = true;  // the interpolated pieces do not even fit 32 bits
  }
  EXPECT_TRUE(differs);
  // A tampered share gives a wrong secret (or is caught as inconsistent).
  auto bad = shares;
  bad[1].y[0] = (bad[1].y[0] + 1) % kShamirPrime;
  bool wrong = false;
  try {
    wrong = reconstruct_secret({bad[0], bad[1], bad[2]}, 3, "test") != secret;
  } catch (const Error&) {
    wrong = true;
  }
  EXPECT_TRUE(wrong);
  // With more shares than the threshold, a tampered one among them is caught, wherever it is.
  EXPECT_EQ(reconstruct_secret(shares, 3, "test"), secret);
  for (size_t k = 0; k < shares.size(); ++k) {
    auto tampered = shares;
    tampered[k].y[2] = (tampered[k].y[2] + 1) % kShamirPrime;
    try {
      reconstruct_secret(tampered, 3, "test");
      ADD_FAILURE() << "a wrong share " << k << " among five was not caught";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the shares are inconsistent"), std::string::npos)
          << e.what();
    }
  }
}

TEST(Shamir, SharesAreFreshAndWireFormatIsChecked) {
  const Key32 secret = key_of(5);
  const auto a = share_secret(secret, 2, {1, 2});
  const auto b = share_secret(secret, 2, {1, 2});
  EXPECT_NE(a[0].y, b[0].y) << "the random coefficients must differ between sharings";
  const Share back = share_from(1, share_bytes(a[0]), "test");
  EXPECT_EQ(back.y, a[0].y);
  EXPECT_THROW(share_from(1, std::string(kShareBytes - 1, '\0'), "test"), Error);
  EXPECT_THROW(share_from(1, std::string(kShareBytes, '\xff'), "test"), Error);  // >= p
  EXPECT_THROW(share_secret(secret, 3, {1, 2}), Error);
  EXPECT_THROW(share_secret(secret, 2, {1, 1}), Error);
  EXPECT_THROW(share_secret(secret, 2, {0, 1}), Error);
  EXPECT_THROW(reconstruct_secret({a[0], a[0]}, 2, "test"), Error);
}

// ---- cryptography -----------------------------------------------------------------------------

TEST(SecAggCrypto, AgreementSealingAndMasks) {
  const KeyPair a = KeyPair::generate(), b = KeyPair::generate();
  EXPECT_EQ(agree(a.secret, b.public_key, "b"), agree(b.secret, a.public_key, "a"));
  const Key32 k = derive(agree(a.secret, b.public_key, "b"), "ctx");
  EXPECT_NE(k, derive(agree(a.secret, b.public_key, "b"), "other ctx"));
  const std::string sealed = seal(k, "aad", "the shares");
  EXPECT_EQ(sealed.size(), kNonceBytes + 10 + kTagBytes);
  EXPECT_EQ(open(k, "aad", sealed, "test"), "the shares");
  EXPECT_THROW(open(k, "other aad", sealed, "test"), Error);
  std::string flipped = sealed;
  flipped[kNonceBytes] ^= 1;
  EXPECT_THROW(open(k, "aad", flipped, "test"), Error);
  EXPECT_THROW(open(derive(k, "x"), "aad", sealed, "test"), Error);
  EXPECT_THROW(agree(a.secret, Key32{}, "zero key"), Error);  // a low-order point
  for (int bits : {32, 64}) {
    std::vector<uint64_t> v(1000, 5);
    add_mask(k, +1, bits, v.data(), v.size());
    EXPECT_GT(std::count_if(v.begin(), v.end(), [](uint64_t w) { return w != 5; }), 990);
    add_mask(k, -1, bits, v.data(), v.size());
    EXPECT_EQ(v, std::vector<uint64_t>(1000, 5));
  }
}

// ---- the masking graph ------------------------------------------------------------------------

TEST(SecAggGraph, HararyGraphIsRegularSymmetricSeededAndConnected) {
  for (size_t n : {5u, 8u, 13u, 40u}) {
    for (int64_t k : {0, 2, 3, 4}) {
      const auto g = neighbour_graph(n, k, 9);
      const size_t d = graph_degree(n, k);
      EXPECT_EQ(neighbour_graph(n, k, 9), g);
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(neighbours_of(n, k, 9, i), g[i]) << "a client's own row, n " << n << " k " << k;
        EXPECT_EQ(g[i].size(), d) << "n " << n << " k " << k;
        EXPECT_EQ(std::set<size_t>(g[i].begin(), g[i].end()).size(), d);
        for (size_t j : g[i]) {
          EXPECT_NE(i, j);
          EXPECT_TRUE(std::binary_search(g[j].begin(), g[j].end(), i));
        }
      }
      std::set<size_t> seen{0};
      std::vector<size_t> todo{0};
      while (!todo.empty()) {
        const size_t i = todo.back();
        todo.pop_back();
        for (size_t j : g[i]) {
          if (seen.insert(j).second) todo.push_back(j);
        }
      }
      EXPECT_EQ(seen.size(), n);
    }
  }
  EXPECT_EQ(graph_degree(40, 0), 39u);
  EXPECT_EQ(graph_degree(40, 4), 4u);
  EXPECT_EQ(graph_degree(13, 3), 4u);  // odd k and odd n: k + 1
  EXPECT_NE(neighbour_graph(40, 4, 1), neighbour_graph(40, 4, 2));
  // A client of the largest roster computes its row alone, in O(n): the whole complete graph
  // would take 80 GB.
  EXPECT_EQ(neighbours_of(100000, 0, 9, 7).size(), 99999u);
  EXPECT_EQ(neighbours_of(100000, 6, 9, 7).size(), 6u);
}

// ---- quantisation -----------------------------------------------------------------------------

TEST(SecAggQuantize, WeightedMeanWithinTheStatedBound) {
  Rng rng(4);
  const int64_t m = 4000;
  std::vector<Weights> deltas(3);
  const std::vector<int64_t> tokens{700, 1300, 5000};
  for (auto& d : deltas) {
    Tensor t = Tensor::empty({m}, DType::f32);
    for (int64_t j = 0; j < m; ++j) t.data<float>()[j] = static_cast<float>(rng.normal() * 0.01);
    d.push_back(t);
  }
  for (bool stochastic : {false, true}) {
    for (int bits : {32, 64}) {
      Options o;
      o.ring_bits = bits;
      o.range = 0.1;
      o.step = bits == 32 ? 0x1p-14 : 0x1p-30;
      o.stochastic = stochastic;
      std::vector<uint64_t> sum(m, 0);
      int64_t total = 0;
      for (size_t i = 0; i < 3; ++i) {
        const auto q = quantize(deltas[i], tokens[i], o, 10 + i);
        for (int64_t j = 0; j < m; ++j) sum[j] = (sum[j] + q[j]) & ring_mask(bits);
        total += tokens[i];
      }
      const Weights got = dequantize(sum, total, static_cast<double>(total), o, deltas[0]);
      double worst = 0, bias = 0;
      for (int64_t j = 0; j < m; ++j) {
        double want = 0;
        for (size_t i = 0; i < 3; ++i) want += tokens[i] * deltas[i][0].data<float>()[j];
        want /= static_cast<double>(total);
        const double err = got[0].data<float>()[j] - want;
        worst = std::max(worst, std::fabs(err));
        bias += err / m;
      }
      // The stated bound plus one float32 rounding of values below 0.1.
      EXPECT_LE(worst, o.error_bound() + 0x1p-27)
          << "bits " << bits << " stochastic " << stochastic;
      if (bits == 32) EXPECT_GT(worst, o.error_bound() / 8) << "the step should matter at 2^-14";
      if (stochastic && bits == 32) EXPECT_LT(std::fabs(bias), o.step / 10) << "unbiased rounding";
      // A word beyond what +-range allows (a client that skipped the clipping) fails the sum.
      std::vector<uint64_t> hostile = sum;
      hostile[7] = (hostile[7] + (uint64_t{1} << (bits - 2))) & ring_mask(bits);
      try {
        dequantize(hostile, total, static_cast<double>(total), o, deltas[0]);
        ADD_FAILURE() << "a sum beyond the range was taken";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("value 7 of the unmasked sum"), std::string::npos)
            << e.what();
      }
    }
  }
}

TEST(SecAggQuantize, ClipsToTheRangeAndRefusesWhatCouldWrap) {
  Options o;
  o.ring_bits = 32;
  o.range = 1;
  o.step = 0x1p-10;
  o.stochastic = false;
  Tensor t = Tensor::empty({3}, DType::f32);
  t.data<float>()[0] = 5;
  t.data<float>()[1] = -7;
  t.data<float>()[2] = 0.5f;
  QuantizeStats stats;
  const auto q = quantize({t}, 2, o, 0, &stats);
  EXPECT_EQ(stats.clipped, 2);
  EXPECT_EQ(ring_signed(q[0], 32), 2 * 1024);
  EXPECT_EQ(ring_signed(q[1], 32), -2 * 1024);
  EXPECT_EQ(ring_signed(q[2], 32), 2 * 512);
  // 2^21 tokens times 2^10 levels reaches 2^31: refused with what to change.
  EXPECT_NO_THROW(check_fits((1 << 21) - 1, o));
  try {
    check_fits(1 << 21, o);
    ADD_FAILURE() << "a sum that may wrap was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("secure_aggregation.step"), std::string::npos) << e.what();
  }
  Tensor nan = Tensor::empty({1}, DType::f32);
  nan.data<float>()[0] = NAN;
  EXPECT_THROW(quantize({nan}, 1, o, 0), Error);
}

// ---- whole rounds -----------------------------------------------------------------------------

TEST(SecAggProtocol, SumIsExactWithoutDropouts) {
  Quiet q;
  for (int bits : {32, 64}) {
    for (int64_t k : {0, 2, 4}) {
      Options o;
      o.ring_bits = bits;
      o.neighbours = k;
      const auto inputs = random_inputs(7, 500, bits, 1 + k);
      const auto r = run_round(inputs, o, {}, {});
      ASSERT_EQ(r.phase, ServerSession::Phase::done) << r.failure;
      EXPECT_EQ(r.sum, plain_sum(inputs, {}, bits)) << "bits " << bits << " k " << k;
    }
  }
}

TEST(SecAggProtocol, SumIsExactWithDropoutsUpToTheThreshold) {
  Quiet q;
  // Complete graph, 7 clients, threshold 4: up to 3 may vanish after sending masked input.
  Options o;
  o.threshold = 4;
  const auto inputs = random_inputs(7, 300, 64, 8);
  auto r = run_round(inputs, o, {}, {1, 4, 6});
  ASSERT_EQ(r.phase, ServerSession::Phase::done) << r.failure;
  EXPECT_EQ(r.sum, plain_sum(inputs, {}, 64)) << "their inputs count: they were sent";
  // Dropping before the input: their pairwise masks are rebuilt from key shares and removed.
  r = run_round(inputs, o, {0, 5}, {3});
  ASSERT_EQ(r.phase, ServerSession::Phase::done) << r.failure;
  EXPECT_EQ(r.sum, plain_sum(inputs, {0, 5}, 64));
  // Dropping before sharing: nobody masks with them, and their inputs are not in the sum.
  r = run_round(inputs, o, {}, {6}, {2});
  ASSERT_EQ(r.phase, ServerSession::Phase::done) << r.failure;
  EXPECT_EQ(r.sum, plain_sum(inputs, {2}, 64));
  // SecAgg+: 12 clients, 4 neighbours (5 holders), majority threshold 3.
  Options sparse;
  sparse.neighbours = 4;
  const auto many = random_inputs(12, 200, 32, 9);
  sparse.ring_bits = 32;
  r = run_round(many, sparse, {2}, {7});
  ASSERT_EQ(r.phase, ServerSession::Phase::done) << r.failure;
  EXPECT_EQ(r.sum, plain_sum(many, {2}, 32));
}

TEST(SecAggProtocol, BelowTheThresholdTheRoundFailsClearly) {
  Quiet q;
  Options o;
  o.threshold = 4;
  const auto inputs = random_inputs(7, 50, 64, 10);
  const auto r = run_round(inputs, o, {}, {0, 1, 2, 3});  // 3 survivors answer: below 4
  EXPECT_EQ(r.phase, ServerSession::Phase::failed);
  EXPECT_NE(r.failure.find("fewer than the threshold 4"), std::string::npos) << r.failure;
  EXPECT_TRUE(r.sum.empty());
  // A threshold above the holders fails at the roster.
  Options high;
  high.threshold = 8;
  const auto r2 = run_round(inputs, high, {}, {});
  EXPECT_EQ(r2.phase, ServerSession::Phase::failed);
  EXPECT_NE(r2.failure.find("exceeds the 7 holders"), std::string::npos) << r2.failure;
}

// Only the survivors reveal: when some secret the sum needs has fewer than threshold holders
// among them, the round fails as the input phase closes, with the counts and nothing revealed,
// instead of opening an unmask phase that can only wait out its deadline.
TEST(SecAggProtocol, TooFewSurvivingHoldersFailBeforeAnyReveal) {
  Quiet q;
  Options o;
  o.threshold = 4;
  auto r = run_round(random_inputs(7, 50, 64, 12), o, {0, 1, 2, 3}, {});  // 3 inputs, below 4
  EXPECT_EQ(r.phase, ServerSession::Phase::failed);
  EXPECT_FALSE(r.unmask_opened);
  EXPECT_NE(r.failure.find("3 of the 7 clients that shared sent a masked input, fewer than the "
                           "threshold 4; nothing is revealed"),
            std::string::npos)
      << r.failure;
  // SecAgg+, 12 clients, 4 neighbours (5 holders), threshold 3: five survivors, c00 and one of
  // its neighbours among them, so c00's self mask has 2 holders left to reveal its shares.
  Options sparse;
  sparse.neighbours = 4;
  const auto graph = neighbour_graph(12, 4, 77);  // run_round's seed
  std::set<size_t> survivors{0, graph[0][0]};
  for (size_t i = 1; i < 12 && survivors.size() < 5; ++i) {
    if (std::find(graph[0].begin(), graph[0].end(), i) == graph[0].end()) survivors.insert(i);
  }
  std::set<size_t> dropped;
  for (size_t i = 0; i < 12; ++i) {
    if (!survivors.count(i)) dropped.insert(i);
  }
  r = run_round(random_inputs(12, 20, 64, 13), sparse, dropped, {});
  EXPECT_EQ(r.phase, ServerSession::Phase::failed);
  EXPECT_FALSE(r.unmask_opened);
  EXPECT_NE(r.failure.find(" of the 5 holders of the shares of "), std::string::npos) << r.failure;
  EXPECT_NE(r.failure.find("fewer than the threshold 3; nothing is revealed"), std::string::npos)
      << r.failure;
}

TEST(SecAggProtocol, MaskedInputsLookUniformWhileTheInputsDoNot) {
  Quiet q;
  Options o;
  // Quantised pseudo-gradients: small integers, far from uniform.
  std::vector<std::vector<uint64_t>> inputs(4, std::vector<uint64_t>(20000));
  Rng rng(3);
  for (auto& v : inputs) {
    for (auto& w : v) w = static_cast<uint64_t>(static_cast<int64_t>(rng.normal() * 3000));
  }
  const auto r = run_round(inputs, o, {}, {});
  ASSERT_EQ(r.phase, ServerSession::Phase::done) << r.failure;
  EXPECT_EQ(r.sum, plain_sum(inputs, {}, 64));
  // 255 degrees of freedom: above 370 has probability about 3e-6 under uniformity.
  for (size_t i = 0; i < r.masked.size(); ++i) {
    EXPECT_LT(byte_chi_square(r.masked[i], 64), 370) << r.senders[i] << "'s masked input";
    EXPECT_GT(byte_chi_square(inputs[i], 64), 10000) << "the unmasked input is not uniform";
  }
}

// The self-mask is what hides an input from a server that says its client dropped after sending
// it: told so, the others reveal that client's mask key, with which the server removes every
// pairwise mask from the input it holds; what is left is x + PRG(b), still uniform, not x. The
// pairwise removal is checked by a second path: the sum of all inputs, whose pairwise masks cancel,
// less the survivors' self-masks (whose seeds the same reveal gives) and inputs (zero here).
TEST(SecAggProtocol, AnInputFalselyReportedDroppedStaysHiddenByItsSelfMask) {
  Quiet q;
  Options o;
  const std::vector<std::string> ids{"c0", "c1", "c2", "c3"};
  const int64_t round = 4;
  const size_t m = 20000;
  ServerSession server(round, ids, o, 11, static_cast<int64_t>(m));
  std::vector<ClientSession> clients;
  for (const auto& id : ids) clients.emplace_back(id, round);
  for (size_t i = 0; i < ids.size(); ++i) server.advertise(ids[i], clients[i].advertise());
  server.close_phase();
  const pb::SecAggRoster roster = server.roster("c1");
  for (size_t i = 0; i < ids.size(); ++i)
    server.shares(ids[i], clients[i].share(server.roster(ids[i])));
  server.close_phase();
  const pb::SecAggInbox inbox0 = server.inbox("c0");
  std::vector<uint64_t> x0(m);  // far from uniform: small integers
  Rng rng(5);
  for (auto& w : x0) w = static_cast<uint64_t>(static_cast<int64_t>(rng.normal() * 3000));
  std::vector<std::vector<uint64_t>> y(ids.size(), std::vector<uint64_t>(m, 0));
  y[0] = x0;
  for (size_t i = 0; i < ids.size(); ++i) clients[i].mask(server.inbox(ids[i]), y[i]);

  pb::SecAggSurvivors lie;  // c0's input arrived, but the server says c0 dropped
  for (const char* id : {"c1", "c2", "c3"}) lie.add_survivors(id);
  lie.add_dropped("c0");
  std::map<std::string, std::vector<Share>> self_mask_shares, mask_key_shares;
  for (size_t v = 1; v < ids.size(); ++v) {
    const pb::SecAggReveal r = clients[v].reveal(lie);
    const auto x = static_cast<uint32_t>(v + 1);  // the holder's roster index + 1
    for (const auto& s : r.self_mask_shares())
      self_mask_shares[s.owner()].push_back(share_from(x, s.share(), "self-mask share"));
    for (const auto& s : r.mask_key_shares())
      mask_key_shares[s.owner()].push_back(share_from(x, s.share(), "mask key share"));
  }
  ASSERT_EQ(mask_key_shares.count("c0"), 1u);
  const Key32 secret0 = reconstruct_secret(mask_key_shares["c0"], server.threshold(), "c0");
  ASSERT_EQ(key_string(public_key_of(secret0)), roster.clients(0).mask_public_key());

  // The server's view of c0's input without its pairwise masks.
  std::vector<uint64_t> left = y[0];
  ASSERT_EQ(inbox0.shares_size(), 3);  // every other client is a neighbour
  for (const auto& share : inbox0.shares()) {
    const std::string& v = share.peer();
    const size_t vi = static_cast<size_t>(std::find(ids.begin(), ids.end(), v) - ids.begin());
    const Key32 pub = key_from(roster.clients(static_cast<int>(vi)).mask_public_key(), v);
    add_mask(pairwise_seed(secret0, pub, round, "c0", v), "c0" < v ? -1 : +1, o.ring_bits,
             left.data(), m);
  }
  // The second path: sum of y, less the survivors' self-masks.
  std::vector<uint64_t> rest(m, 0);
  for (const auto& yi : y)
    for (size_t j = 0; j < m; ++j) rest[j] = (rest[j] + yi[j]) & ring_mask(o.ring_bits);
  for (size_t v = 1; v < ids.size(); ++v) {
    const Key32 b = reconstruct_secret(self_mask_shares[ids[v]], server.threshold(), ids[v]);
    add_mask(self_mask_seed(b, round, ids[v]), -1, o.ring_bits, rest.data(), m);
  }
  ASSERT_EQ(left, rest) << "the pairwise masks were not removed as the protocol adds them";

  size_t same = 0;
  for (size_t j = 0; j < m; ++j) same += left[j] == x0[j];
  EXPECT_LT(same, 5u) << "the server recovered c0's input";
  EXPECT_LT(byte_chi_square(left, o.ring_bits), 370);  // 255 degrees of freedom, as above
  EXPECT_GT(byte_chi_square(x0, o.ring_bits), 10000);
}

// A client checks the lists before it reveals: too few survivors, one listed in both, a list that
// leaves someone out, or one that leaves this client out would each let the server ask for both
// secrets of one client or unmask with fewer than the threshold.
TEST(SecAggProtocol, RevealRefusesListsThatCouldUnmaskOneInput) {
  Quiet q;
  Options o;
  const std::vector<std::string> ids{"a", "b", "c", "d"};
  ServerSession server(2, ids, o, 9, 4);
  std::vector<ClientSession> clients;
  for (const auto& id : ids) clients.emplace_back(id, 2);
  for (size_t i = 0; i < ids.size(); ++i) server.advertise(ids[i], clients[i].advertise());
  server.close_phase();
  for (size_t i = 0; i < ids.size(); ++i)
    server.shares(ids[i], clients[i].share(server.roster(ids[i])));
  server.close_phase();
  std::vector<uint64_t> x(4, 0);
  clients[0].mask(server.inbox("a"), x);
  auto list = [](std::vector<std::string> survivors, std::vector<std::string> dropped) {
    pb::SecAggSurvivors l;
    for (const auto& s : survivors) l.add_survivors(s);
    for (const auto& s : dropped) l.add_dropped(s);
    return l;
  };
  auto refused = [&](const pb::SecAggSurvivors& l) {
    return pollen::testing::error_of([&] { clients[0].reveal(l); });
  };
  // threshold 3 of 4 holders: 2 survivors are too few
  EXPECT_NE(refused(list({"a", "b"}, {"c", "d"})).find("fewer than the threshold 3"),
            std::string::npos);
  EXPECT_NE(refused(list({"a", "b", "c"}, {"c", "d"})).find("also survived"), std::string::npos);
  EXPECT_NE(refused(list({"a", "b", "c"}, {})).find("every client that shared keys"),
            std::string::npos);
  EXPECT_NE(refused(list({"b", "c", "d"}, {"a"})).find("not among the survivors"),
            std::string::npos);
  EXPECT_NE(refused(list({"a", "b", "b", "c"}, {"d"})).find("listed twice"), std::string::npos);
  // The session is still waiting: a list that holds reveals once.
  const pb::SecAggReveal r = clients[0].reveal(list({"a", "b", "c"}, {"d"}));
  EXPECT_EQ(r.self_mask_shares_size(), 3);  // of a, b and c (a holds its own)
  EXPECT_EQ(r.mask_key_shares_size(), 1);   // of d
  EXPECT_THROW(clients[0].reveal(list({"a", "b", "c"}, {"d"})), Error);
}

// A low-order X25519 key would make every neighbour's agreement with it fail in the share
// phase, failing the round without naming anyone: it is refused at advertise, naming the client
// and the key, and the round goes on without that client.
TEST(SecAggProtocol, LowOrderKeysAreRefusedAtAdvertise) {
  Quiet q;
  Options o;
  ServerSession server(1, {"a", "b", "c"}, o, 5, 4);
  ClientSession a("a", 1), b("b", 1), c("c", 1);
  const pb::SecAggKeys kc = c.advertise();
  std::string one(32, '\0');
  one[0] = 1;  // u = 1, a point of order 4
  for (const auto& [field, bad] :
       {std::pair{"cipher_public_key", std::string(32, '\0')}, std::pair{"mask_public_key", one}}) {
    pb::SecAggKeys k = kc;
    if (std::string(field) == "cipher_public_key") {
      k.set_cipher_public_key(bad);
    } else {
      k.set_mask_public_key(bad);
    }
    const std::string why = pollen::testing::error_of([&] { server.advertise("c", k); });
    EXPECT_NE(why.find(std::string("secure aggregation keys from 'c', ") + field),
              std::string::npos)
        << why;
    EXPECT_NE(why.find("degenerate"), std::string::npos) << why;
  }
  server.advertise("a", a.advertise());
  server.advertise("b", b.advertise());
  server.close_phase();  // the deadline: c sent no valid keys
  ASSERT_EQ(server.phase(), ServerSession::Phase::share) << server.failure();
  const pb::SecAggRoster roster = server.roster("a");
  EXPECT_EQ(roster.clients_size(), 2);
  EXPECT_NO_THROW(a.share(roster));
}

TEST(SecAggProtocol, HostileMessagesAreRefused) {
  Quiet q;
  Options o;
  const std::vector<std::string> ids{"a", "b", "c"};
  ServerSession server(1, ids, o, 5, 10);
  ClientSession a("a", 1), b("b", 1), c("c", 1);
  auto ka = a.advertise();
  EXPECT_THROW(a.advertise(), Error);  // once per round
  pb::SecAggKeys short_key = ka;
  short_key.set_mask_public_key("short");
  EXPECT_THROW(server.advertise("a", short_key), Error);
  EXPECT_THROW(server.advertise("b", ka), Error);  // keys naming another client
  EXPECT_THROW(server.advertise("z", ka), Error);  // not selected
  server.advertise("a", ka);
  EXPECT_THROW(server.advertise("a", ka), Error);  // twice
  EXPECT_THROW(server.roster("a"), Error);         // wrong phase
  server.advertise("b", b.advertise());
  server.advertise("c", c.advertise());
  server.close_phase();
  pb::SecAggRoster roster = server.roster("a");
  pb::SecAggRoster altered = roster;
  altered.mutable_clients(0)->set_mask_public_key(std::string(32, '\x09'));
  ClientSession a2("a", 1);
  a2.advertise();
  EXPECT_THROW(a2.share(roster), Error);  // a roster without this session's keys
  pb::SecAggRoster unsorted = roster;
  unsorted.mutable_clients()->SwapElements(0, 1);
  EXPECT_THROW(a.share(unsorted), Error);
  pb::SecAggRoster low = roster;
  low.mutable_params()->set_threshold(1);
  EXPECT_THROW(a.share(low), Error);
  auto sa = a.share(roster);
  pb::SecAggShares wrong_size = sa;
  wrong_size.mutable_shares(0)->set_ciphertext("x");
  EXPECT_THROW(server.shares("a", wrong_size), Error);
  pb::SecAggShares duplicate = sa;
  *duplicate.add_shares() = sa.shares(0);
  EXPECT_THROW(server.shares("a", duplicate), Error);
  server.shares("a", sa);
  server.shares("b", b.share(server.roster("b")));
  server.shares("c", c.share(server.roster("c")));
  server.close_phase();
  // A share the server swapped between senders does not authenticate.
  pb::SecAggInbox box = server.inbox("c");
  ASSERT_EQ(box.shares_size(), 2);
  std::swap(*box.mutable_shares(0)->mutable_ciphertext(),
            *box.mutable_shares(1)->mutable_ciphertext());
  std::vector<uint64_t> x(10, 0);
  EXPECT_THROW(c.mask(box, x), Error);
  EXPECT_THROW(server.add_input("a", std::string(7, '\0')), Error);  // wrong size
}
