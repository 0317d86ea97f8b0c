// Shared second moments (fed/second_moments.h): the factored form, its average, and a federation
// in which the server averages what the clients send and hands it back with the next model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/config.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/second_moments.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

const ParamSpecs kSpecs{{"w", {3, 4}}, {"norm", {5}}};

Tensor filled(const Shape& shape, const std::function<float(int64_t)>& f) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (int64_t j = 0; j < t.numel(); ++j) t.data<float>()[j] = f(j);
  return t;
}

std::vector<float> pull_second_moments(Coordinator& server, const std::string& id, int64_t round) {
  pb::PullRequest r;
  r.set_client_id(id);
  r.set_round(round);
  const auto set = server.pull(r, "");
  return unpack_second_moments(server.specs(), set->header.second_moments(), "pull");
}

// Bytes of the factored form on the wire: a value a byte, and 8 bytes a segment (each matrix's
// rows and columns, each other tensor).
uint64_t wire_bytes(const ParamSpecs& specs) {
  uint64_t segments = 0;
  for (const auto& s : specs) segments += s.shape.size() == 2 ? 2 : 1;
  return static_cast<uint64_t>(factored_size(specs)) + 8 * segments;
}

}  // namespace

TEST(SecondMoments, FactoredFormIsRowAndColumnMeansAndRebuildsARankOneMatrix) {
  // v[i][j] = a[i] b[j]: row means a[i] mean(b), column means mean(a) b[j].
  const std::vector<float> a{1, 2, 4}, b{0.5f, 1, 3, 0.25f};
  const Tensor w = filled({3, 4}, [&](int64_t k) { return a[k / 4] * b[k % 4]; });
  const Tensor norm = filled({5}, [](int64_t k) { return 0.1f * static_cast<float>(k + 1); });
  EXPECT_EQ(factored_size(kSpecs), 3 + 4 + 5);
  const std::vector<float> f = factor_second_moments(kSpecs, {&w, &norm});
  ASSERT_EQ(f.size(), 12u);
  const double mean_b = (0.5 + 1 + 3 + 0.25) / 4, mean_a = 7.0 / 3;
  for (int i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(f[i], static_cast<float>(a[i] * mean_b));
  for (int j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(f[3 + j], static_cast<float>(mean_a * b[j]));
  for (int k = 0; k < 5; ++k) EXPECT_EQ(f[7 + k], norm.data<float>()[k]);  // vectors whole

  Tensor w2 = Tensor::zeros({3, 4}, DType::f32), norm2 = Tensor::zeros({5}, DType::f32);
  expand_second_moments(kSpecs, f, {&w2, &norm2});
  for (int64_t k = 0; k < 12; ++k)
    EXPECT_NEAR(w2.data<float>()[k], w.data<float>()[k], 1e-6 * w.data<float>()[k]) << k;
  EXPECT_EQ(std::memcmp(norm2.raw(), norm.raw(), norm.nbytes()), 0);
  // A matrix that is not rank one keeps its row and column means, not its values.
  const Tensor bumpy = filled({3, 4}, [](int64_t k) { return k == 5 ? 9.0f : 1.0f; });
  expand_second_moments(kSpecs, factor_second_moments(kSpecs, {&bumpy, &norm}), {&w2, &norm2});
  const std::vector<float> again = factor_second_moments(kSpecs, {&w2, &norm2});
  const std::vector<float> want = factor_second_moments(kSpecs, {&bumpy, &norm});
  for (size_t k = 0; k < 7; ++k) EXPECT_NEAR(again[k], want[k], 1e-5) << k;
  EXPECT_NE(w2.data<float>()[5], 9.0f);
}

TEST(SecondMoments, PiecesFactorAndRebuildAsTheWholeTensorsDo) {
  // ZeRO-1 keeps each rank's blocks of v: runs that start and end mid-row. Two "ranks" each add
  // their runs into their own sums; the sums added then give the whole tensors' factored form,
  // and each run rebuilt alone is that run of the whole rebuilt tensor, bit for bit.
  const Tensor w = filled({3, 4}, [](int64_t k) { return 0.25f * static_cast<float>(1 + k * k); });
  const Tensor norm = filled({5}, [](int64_t k) { return 0.1f * static_cast<float>(k + 1); });
  const std::vector<float> whole = factor_second_moments(kSpecs, {&w, &norm});
  const size_t n = whole.size();
  std::vector<double> rank0(n, 0.0), rank1(n, 0.0);
  add_factor_sums(kSpecs, 0, 5, w.data<float>() + 5, 7, rank0);  // rows 1 (from column 1) and 2
  add_factor_sums(kSpecs, 1, 0, norm.data<float>(), 2, rank0);
  add_factor_sums(kSpecs, 0, 0, w.data<float>(), 5, rank1);  // row 0 and column 0 of row 1
  add_factor_sums(kSpecs, 1, 2, norm.data<float>() + 2, 3, rank1);
  std::vector<double> sum(n);
  for (size_t k = 0; k < n; ++k) sum[k] = rank0[k] + rank1[k];
  const std::vector<float> pieces = factor_means(kSpecs, sum);
  for (size_t k = 0; k < n; ++k) EXPECT_FLOAT_EQ(pieces[k], whole[k]) << k;
  EXPECT_NE(factor_means(kSpecs, rank0)[0], whole[0]);  // one rank's runs alone are not it

  Tensor w2 = Tensor::zeros({3, 4}, DType::f32), norm2 = Tensor::zeros({5}, DType::f32);
  expand_second_moments(kSpecs, whole, {&w2, &norm2});
  std::vector<float> run(7, -1.0f);
  expand_second_moments_range(kSpecs, whole, 0, 5, 7, run.data());
  EXPECT_EQ(std::memcmp(run.data(), w2.data<float>() + 5, 7 * sizeof(float)), 0);
  expand_second_moments_range(kSpecs, whole, 1, 2, 3, run.data());
  EXPECT_EQ(std::memcmp(run.data(), norm2.data<float>() + 2, 3 * sizeof(float)), 0);
}

TEST(SecondMoments, ExtremeMeansRebuildToFiniteValues) {
  // The largest float32 row and column means over a tiny overall mean: R C / mean(R) would
  // overflow float32; the rebuilt v stays finite.
  std::vector<float> f(12, 1e-30f);
  f[0] = f[3] = std::numeric_limits<float>::max();
  Tensor w = Tensor::zeros({3, 4}, DType::f32), norm = Tensor::zeros({5}, DType::f32);
  expand_second_moments(kSpecs, f, {&w, &norm});
  for (int64_t k = 0; k < 12; ++k) EXPECT_TRUE(std::isfinite(w.data<float>()[k])) << k;
  EXPECT_EQ(w.data<float>()[0], std::numeric_limits<float>::max());
}

TEST(SecondMoments, TheTrainersMomentsTakeTheSharedOnesInItsOrderAndScale) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("second_moments_trainer");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 1, 1).clients[0];
  LocalTrainer trainer(cfg);
  trainer.train(3);
  // Distinct values everywhere: another parameter order, a transposed matrix or a missed bias
  // correction would give other row and column means back.
  std::vector<Tensor> v;
  for (const auto& spec : trainer.exchanged_specs())
    v.push_back(
        filled(spec.shape, [](int64_t k) { return 1e-4f * static_cast<float>(1 + k % 97); }));
  std::vector<const Tensor*> each;
  for (const auto& t : v) each.push_back(&t);
  const std::vector<float> shared = factor_second_moments(trainer.exchanged_specs(), each);
  trainer.set_second_moments(shared);
  const std::vector<float> back = trainer.factored_second_moments();
  ASSERT_EQ(back.size(), shared.size());
  for (size_t k = 0; k < shared.size(); ++k) EXPECT_NEAR(back[k], shared[k], 1e-5 * shared[k]) << k;
  fs::remove_all(dir);
}

TEST(SecondMoments, AverageIsWeightedAndBadValuesAreRefused) {
  const std::vector<float> x{1, 2, 0}, y{3, 6, 4};
  const auto avg = average_second_moments({&x, &y}, {1, 3});
  EXPECT_EQ(avg, (std::vector<float>{2.5f, 5.0f, 3.0f}));
  auto error_of = [](const std::vector<float>& v, int64_t size) -> std::string {
    try {
      check_second_moments(v.data(), static_cast<int64_t>(v.size()), size, "update from 'a'");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error_of({1, 0, 2}, 3), "");
  EXPECT_NE(error_of({1, 2}, 3).find("2 second-moment values"), std::string::npos);
  EXPECT_NE(error_of({1, -1, 2}, 3).find("value 1 is -1"), std::string::npos);
  EXPECT_NE(error_of({1, NAN, 2}, 3).find("value 1"), std::string::npos);
}

TEST(SecondMoments, OnTheWireEachSegmentIsEightBitLogCodesBetweenItsExtremes) {
  // Segments of kSpecs: w's 3 row means, its 4 column means, norm's 5 values.
  const std::vector<float> f{1, 2,     4,             // lo 0, hi 2: codes 1, 128, 255, exact
                             0, 1,     1, 1,          // one level: lo = hi = 0; zero is code 0
                             1, 1.01f, 3, 1e-3f, 0};  // spans log2(3000) = 11.55
  const std::string packed = pack_second_moments(kSpecs, f);
  ASSERT_EQ(packed.size(), 12 + 3 * 8u);
  ASSERT_EQ(wire_bytes(kSpecs), packed.size());
  float lo, hi;
  std::memcpy(&lo, packed.data(), 4);
  std::memcpy(&hi, packed.data() + 4, 4);
  EXPECT_EQ(lo, 0.0f);
  EXPECT_EQ(hi, 2.0f);
  EXPECT_EQ(static_cast<uint8_t>(packed[8]), 1);
  EXPECT_EQ(static_cast<uint8_t>(packed[9]), 128);
  EXPECT_EQ(static_cast<uint8_t>(packed[10]), 255);
  EXPECT_EQ(static_cast<uint8_t>(packed[11 + 8]), 0);  // the column means' zero
  const auto back = unpack_second_moments(kSpecs, packed, "x");
  ASSERT_EQ(back.size(), f.size());
  for (size_t k = 0; k < 7; ++k) EXPECT_EQ(back[k], f[k]) << k;
  // Within a factor 2^(span / 508) elsewhere; the extremes and zero exact to float rounding.
  const double factor = std::exp2(std::log2(3000.0) / 508);
  for (size_t k = 7; k < 12; ++k) {
    EXPECT_LE(back[k], f[k] * factor * (1 + 1e-6)) << k;
    EXPECT_GE(back[k], f[k] / factor / (1 + 1e-6)) << k;
  }
  EXPECT_NEAR(back[9], 3.0f, 3e-6);
  EXPECT_NEAR(back[10], 1e-3f, 1e-9);
  EXPECT_EQ(back[11], 0.0f);
  EXPECT_NE(back[8], 1.01f);  // 8 bits cannot keep 1% steps over 11.5 octaves

  auto error_of = [&](const std::string& bytes) -> std::string {
    try {
      unpack_second_moments(kSpecs, bytes, "update from 'a'");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of(packed.substr(1)).find("35 bytes of second moments"), std::string::npos);
  auto with_range = [&](size_t segment_at, float l, float h) {
    std::string bad = packed;
    std::memcpy(bad.data() + segment_at, &l, 4);
    std::memcpy(bad.data() + segment_at + 4, &h, 4);
    return error_of(bad);
  };
  const size_t norm_at = 8 + 3 + 8 + 4;  // the third segment's header
  EXPECT_EQ(with_range(norm_at, -10, 1.6f), "");
  EXPECT_NE(with_range(norm_at, 2, 1).find("segment 2 has log2 range [2, 1]"), std::string::npos);
  EXPECT_NE(with_range(norm_at, 0, 128).find("segment 2"), std::string::npos);  // 2^128 = inf
  EXPECT_NE(with_range(0, NAN, 1).find("segment 0"), std::string::npos);
  EXPECT_EQ(pack_second_moments(kSpecs, {}), "");  // none yet: nothing sent
}

TEST(SecondMoments, ServerAveragesTheClientsAndSendsItWithTheNextModel) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("second_moments");
  const auto silo_a = make_silo(dir / "a", 1), silo_b = make_silo(dir / "b", 3);
  auto run = [&](const std::string& name, const std::string& second_moments) {
    auto cfg = sim_config(dir / name, {silo_a, silo_b}, "fedavg", 2, 3);
    cfg.server.strategy.second_moments = second_moments;
    Coordinator server(cfg.server, false);
    LocalTransport to_a(server), to_b(server);
    Client a(cfg.clients[0], to_a), b(cfg.clients[1], to_b);
    a.join(), b.join();
    EXPECT_TRUE(server.begin_round());
    EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
    EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
    const std::vector<float> fa = a.trainer().factored_second_moments();
    const std::vector<float> fb = b.trainer().factored_second_moments();
    EXPECT_TRUE(server.end_round().aggregated);
    const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
    const auto ta = m[0]["clients"]["silo-0"]["tokens"].get<double>();
    const auto tb = m[0]["clients"]["silo-1"]["tokens"].get<double>();
    EXPECT_TRUE(server.begin_round());
    // Round 2's model comes with the clients' round-1 moments averaged by tokens, bitwise.
    std::vector<float> sent;
    if (second_moments != "none") {
      sent = pull_second_moments(server, "silo-0", 2);
      // Each way in 8-bit codes: the clients' moments rounded, averaged, rounded again.
      const auto& specs = server.specs();
      const auto wa = unpack_second_moments(specs, pack_second_moments(specs, fa), "a");
      const auto wb = unpack_second_moments(specs, pack_second_moments(specs, fb), "b");
      EXPECT_EQ(sent,
                unpack_second_moments(
                    specs, pack_second_moments(specs, average_second_moments({&wa, &wb}, {ta, tb})),
                    "average"));
    }
    EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
    EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
    const std::vector<float> after = a.trainer().factored_second_moments();
    EXPECT_TRUE(server.end_round().aggregated);
    // Both rounds' updates carry the factored moments, round 2's model too.
    const auto m2 = read_jsonl(cfg.server.dir / "metrics.jsonl");
    return std::tuple{sent, after, m2, static_cast<uint64_t>(factored_size(server.specs())),
                      wire_bytes(server.specs())};
  };
  const auto [sent, shared, m_shared, n, wire] = run("shared", "factored");
  const auto [none, own, m_own, n_own, wire_own] = run("own", "none");
  ASSERT_EQ(sent.size(), n);
  EXPECT_TRUE(none.empty());
  // Client a started round 2 from the average, not from its own moments.
  EXPECT_NE(shared, own);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(m_shared[r]["bytes_received"].get<uint64_t>(),
              m_own[r]["bytes_received"].get<uint64_t>() + 2 * wire)
        << "round " << r + 1;
  }
  EXPECT_EQ(m_shared[0]["bytes_sent"], m_own[0]["bytes_sent"]);  // nothing to share before round 2
  EXPECT_EQ(m_shared[1]["bytes_sent"].get<uint64_t>(),
            m_own[1]["bytes_sent"].get<uint64_t>() + 2 * wire);
  fs::remove_all(dir);
}

TEST(SecondMoments, BadMomentsInAnUpdateAndUnprotectedCombinationsAreRefused) {
  Quiet q;
  const auto dir = temp_dir("second_moments_refused");
  ServerConfig sc = sim_config(dir, {}, "fedavg", 2, 1).server;
  sc.strategy.second_moments = "factored";
  Coordinator server(sc, false);
  ASSERT_TRUE(server.join(tiny_join("a"), "").accepted());
  ASSERT_TRUE(server.begin_round());
  pb::TaskRequest ask;
  ask.set_client_id("a");
  EXPECT_TRUE(server.task(ask, "").second_moments());
  Weights zeros;
  for (const auto& s : server.specs()) zeros.push_back(Tensor::zeros(s.shape, DType::f32));
  const EncodedSet update = encode_weights(server.specs(), zeros, CompressOptions{});
  const int64_t n = factored_size(server.specs());
  auto push_error = [&](const std::string& moments) -> std::string {
    pb::UpdateInfo info;
    info.set_client_id("a");
    info.set_round(1);
    info.set_tokens(10);
    info.set_second_moments(moments);
    try {
      server.push_begin(info, update.header, "");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(push_error("").find("0 bytes of second moments"), std::string::npos);
  const std::string ones =
      pack_second_moments(server.specs(), std::vector<float>(static_cast<size_t>(n), 1.0f));
  std::string inverted = ones;
  const float five = 5;
  std::memcpy(inverted.data(), &five, 4);  // the first segment's lo above its hi (0)
  EXPECT_NE(push_error(inverted).find("log2 range [5, 0]"), std::string::npos);
  EXPECT_EQ(push_error(ones), "");

  // The moments travel in the clear: not with secure aggregation or central DP.
  const std::string base =
      "[server]\ndir = 'x'\n" + kTinyModelToml + "[strategy]\nsecond_moments = 'factored'\n";
  write_file_atomic(dir / "ok.toml", base);
  EXPECT_EQ(load_server_config(dir / "ok.toml").strategy.second_moments, "factored");
  write_file_atomic(dir / "secagg.toml", base + "[secure_aggregation]\nenabled = true\n");
  try {
    load_server_config(dir / "secagg.toml");
    ADD_FAILURE() << "second moments accepted with secure aggregation";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("second_moments"), std::string::npos) << e.what();
  }
  for (const std::string& other : {"[privacy]\nnoise_multiplier = 1.0\nclip = 1.0\n",
                                   "[strategy]\naggregation = 'median'\n"}) {
    std::string toml = base + other;
    if (other.rfind("[strategy]", 0) == 0)  // one [strategy] table
      toml = base.substr(0, base.find("[strategy]")) +
             "[strategy]\nsecond_moments = 'factored'\naggregation = 'median'\n";
    write_file_atomic(dir / "other.toml", toml);
    try {
      load_server_config(dir / "other.toml");
      ADD_FAILURE() << "second moments accepted with " << other;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("second_moments"), std::string::npos) << e.what();
    }
  }
  write_file_atomic(dir / "bad.toml", "[server]\ndir = 'x'\n" + kTinyModelToml +
                                          "[strategy]\nsecond_moments = 'exact'\n");
  EXPECT_THROW(load_server_config(dir / "bad.toml"), Error);
  fs::remove_all(dir);
}
