// The compressed model download (fed/model_view.h): a delta against the model the client holds,
// rebuilt bitwise on the client, error-fed through the view, and the whole model for a client
// that holds another.
#include <gtest/gtest.h>

#include "base/rng.h"
#include "fed/fixtures.h"
#include "fed/model_view.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

const ParamSpecs kSpecs{{"a", {3, 40}}, {"b", {17}}};

Weights random_weights(uint64_t seed, double scale) {
  Rng rng(seed);
  Weights w;
  for (const auto& s : kSpecs) {
    Tensor t = Tensor::empty(s.shape, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<float>()[i] = static_cast<float>(scale * rng.normal());
    w.push_back(std::move(t));
  }
  return w;
}

// What a client does with a pulled set: the header's checks, then the rebuilt model.
const Weights& pull(HeldModel& held, ModelPublisher& server, const CompressOptions& codec) {
  const auto set = server.for_client(held.sha256());
  held.validate(set->header, kSpecs, codec, "test pull");
  return held.receive(set->header, set->bytes, kSpecs, "test pull");
}

uint64_t numel() {
  uint64_t n = 0;
  for (const auto& s : kSpecs) n += static_cast<uint64_t>(shape_numel(s.shape));
  return n;
}

}  // namespace

TEST(ModelView, ClientRebuildsTheServersViewBitwiseFromDeltas) {
  const CompressOptions int4{Codec::int4, 16, 0};
  const Weights x0 = random_weights(1, 0.05);
  ModelPublisher server(kSpecs, int4, clone_weights(x0));
  HeldModel client(clone_weights(x0));
  Weights x = x0;
  for (int round = 1; round <= 4; ++round) {
    x = plus(x, random_weights(10 + static_cast<uint64_t>(round), 1e-3));  // the outer step
    server.publish(x);
    const auto set = server.for_client(client.sha256());
    EXPECT_EQ(set->header.codec(), "int4");
    EXPECT_EQ(set->header.total_bytes(), encoded_bytes(int4, 120) + encoded_bytes(int4, 17));
    const Weights& got = pull(client, server, int4);
    EXPECT_TRUE(bitwise_equal(got, server.view())) << "round " << round;
    // The delta's rounding is of the move (about 1e-3), not of the weights (about 0.05): int4 of
    // x itself would miss by up to max|x| / 14, more than 0.005.
    EXPECT_LT(worst_difference(got, x), 4e-4) << "round " << round;
  }
}

double mean_difference(const Weights& a, const Weights& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (int64_t j = 0; j < a[i].numel(); ++j)
      sum += std::fabs(static_cast<double>(a[i].data<float>()[j]) - b[i].data<float>()[j]);
  return sum / static_cast<double>(numel());
}

TEST(ModelView, WhatADeltaMissesGoesOutWithTheNext) {
  // The model moves once and then stays: each publish sends what the view still misses, so the
  // view closes in on x (error feedback through the view). Re-encoding x - x0 alone each round
  // would leave the first round's error in place.
  const CompressOptions sign{Codec::sign, 8, 0};
  const Weights x0 = random_weights(2, 0.05);
  ModelPublisher server(kSpecs, sign, clone_weights(x0));
  HeldModel client(clone_weights(x0));
  const Weights x = plus(x0, random_weights(3, 1e-2));
  server.publish(x);
  const double first = mean_difference(pull(client, server, sign), x);
  EXPECT_GT(first, 1e-3);  // sign keeps only each block's mean magnitude
  for (int round = 2; round <= 12; ++round) server.publish(x), pull(client, server, sign);
  EXPECT_LT(mean_difference(server.view(), x), first / 4);
}

TEST(ModelView, AClientHoldingAnotherModelGetsTheWholeViewExactly) {
  const CompressOptions int8{Codec::int8, 16, 0};
  const Weights x0 = random_weights(4, 0.05);
  ModelPublisher server(kSpecs, int8, clone_weights(x0));
  HeldModel fresh(random_weights(5, 0.05));  // another initial model, or a restarted client
  server.publish(plus(x0, random_weights(6, 1e-3)));
  const auto set = server.for_client(fresh.sha256());
  EXPECT_EQ(set->header.codec(), "none");
  EXPECT_TRUE(set->header.base_sha256().empty());
  EXPECT_EQ(set->header.total_bytes(), 4 * numel());
  EXPECT_TRUE(bitwise_equal(pull(fresh, server, int8), server.view()));
  // Now it holds the view: the next round comes as a delta.
  server.publish(plus(server.view(), random_weights(7, 1e-3)));
  EXPECT_EQ(server.for_client(fresh.sha256())->header.codec(), "int8");
  EXPECT_TRUE(bitwise_equal(pull(fresh, server, int8), server.view()));
}

TEST(ModelView, AClientThatMissedRoundsGetsTheChainOfDeltasWhileItIsSmallerThanTheModel) {
  // int8 in blocks of 16: a delta is 177 bytes (a byte a value, 10 float32 scales) against the
  // model's 548, so the server keeps three rounds' deltas; a fourth would outweigh the model.
  const CompressOptions int8{Codec::int8, 16, 0};
  const uint64_t delta_bytes = encoded_bytes(int8, 120) + encoded_bytes(int8, 17);
  ASSERT_LT(3 * delta_bytes, 4 * numel());
  ASSERT_GE(4 * delta_bytes, 4 * numel());
  const Weights x0 = random_weights(21, 0.05);
  ModelPublisher server(kSpecs, int8, clone_weights(x0));
  HeldModel steady(clone_weights(x0)), behind(clone_weights(x0)), further(clone_weights(x0));
  Weights x = clone_weights(x0);
  for (int round = 1; round <= 3; ++round) {
    x = plus(x, random_weights(30 + round, 1e-2));
    server.publish(x);
    pull(steady, server, int8);
  }
  EXPECT_EQ(server.chain_length(), 3u);
  // Three pulls, a delta each, from the view it holds to the next; then it holds the round's.
  for (int link = 1; link <= 3; ++link) {
    const auto set = server.for_client(behind.sha256());
    EXPECT_EQ(set->header.base_sha256(), behind.sha256()) << "link " << link;
    EXPECT_EQ(set->header.total_bytes(), delta_bytes) << "link " << link;
    pull(behind, server, int8);
    EXPECT_EQ(behind.sha256() == server.view_sha256(), link == 3) << "link " << link;
  }
  EXPECT_TRUE(bitwise_equal(behind.model(), steady.model()));

  // Round 4: the oldest delta goes, and a client still at x0 gets the whole view instead.
  server.publish(plus(x, random_weights(34, 1e-2)));
  pull(steady, server, int8);
  EXPECT_EQ(server.chain_length(), 3u);
  const auto set = server.for_client(further.sha256());
  EXPECT_TRUE(set->header.base_sha256().empty());
  EXPECT_EQ(set->header.total_bytes(), 4 * numel());
  EXPECT_TRUE(bitwise_equal(pull(further, server, int8), steady.model()));
}

TEST(ModelView, APublishThatLeavesTheViewWhereItWasAddsNoLink) {
  // A retried round of a model that did not move: its delta is zero, so the view keeps its name
  // and the chain its links.
  const CompressOptions int8{Codec::int8, 16, 0};
  const Weights x0 = random_weights(41, 0.05);
  ModelPublisher server(kSpecs, int8, clone_weights(x0));
  HeldModel behind(clone_weights(x0));
  server.publish(plus(x0, random_weights(42, 1e-2)));
  const std::string v1 = server.view_sha256();
  server.publish(server.view());
  EXPECT_EQ(server.view_sha256(), v1);
  EXPECT_EQ(server.chain_length(), 1u);
  EXPECT_TRUE(bitwise_equal(pull(behind, server, int8), server.view()));
  EXPECT_EQ(behind.sha256(), v1);
}

TEST(ModelView, OnlyTheNewestLinkCarriesTheRoundsSecondMoments) {
  const CompressOptions int8{Codec::int8, 16, 0};
  const Weights x0 = random_weights(51, 0.05);
  ModelPublisher server(kSpecs, int8, clone_weights(x0));
  HeldModel behind(clone_weights(x0));
  server.set_second_moments("round 1");
  server.publish(plus(x0, random_weights(52, 1e-2)));
  server.set_second_moments("round 2");
  const Weights x2 = plus(server.view(), random_weights(53, 1e-2));
  server.publish(x2);
  ASSERT_EQ(server.chain_length(), 2u);
  EXPECT_EQ(server.for_client(behind.sha256())->header.second_moments(), "");
  pull(behind, server, int8);
  EXPECT_EQ(server.for_client(behind.sha256())->header.second_moments(), "round 2");
  // A round that leaves the view where it was: the newest link takes its moments.
  server.set_second_moments("round 3");
  server.publish(server.view());
  EXPECT_EQ(server.chain_length(), 2u);
  EXPECT_EQ(server.for_client(behind.sha256())->header.second_moments(), "round 3");
}

TEST(ModelView, AClientThatHoldsTheRoundsModelGetsAnEmptyDelta) {
  // A pull retried within the round, or after a server restart: the client applied the round's
  // delta already and must not get it (or the whole model) again.
  for (const Codec c : {Codec::int8, Codec::nf2, Codec::sign, Codec::topk}) {
    const CompressOptions codec{c, 16, c == Codec::topk ? 4 : 0};
    const Weights x0 = random_weights(11, 0.05);
    ModelPublisher server(kSpecs, codec, clone_weights(x0));
    HeldModel client(clone_weights(x0));
    server.publish(plus(x0, random_weights(12, 1e-3)));
    const Weights first = clone_weights(pull(client, server, codec));
    const auto again = server.for_client(client.sha256());
    EXPECT_EQ(again->header.base_sha256(), client.sha256()) << codec_name(c);
    EXPECT_EQ(again->header.total_bytes(), encoded_bytes(codec, 120) + encoded_bytes(codec, 17));
    EXPECT_TRUE(bitwise_equal(pull(client, server, codec), first)) << codec_name(c);
    EXPECT_TRUE(bitwise_equal(client.model(), server.view())) << codec_name(c);
  }
}

TEST(ModelView, ADeltaToAnotherModelOrAWrongResultIsRefused) {
  const CompressOptions int8{Codec::int8, 16, 0};
  const Weights x0 = random_weights(8, 0.05);
  ModelPublisher server(kSpecs, int8, clone_weights(x0));
  HeldModel held(clone_weights(x0));
  server.publish(plus(x0, random_weights(9, 1e-3)));
  const auto set = server.for_client(held.sha256());
  HeldModel other(random_weights(10, 0.05));
  try {
    other.validate(set->header, kSpecs, int8, "pull");
    ADD_FAILURE() << "a delta to another model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("this client holds " + other.sha256()), std::string::npos)
        << e.what();
  }
  pb::TensorSetHeader wrong = set->header;
  wrong.set_model_sha256(std::string(64, 'a'));
  held.validate(wrong, kSpecs, int8, "pull");
  try {
    held.receive(wrong, set->bytes, kSpecs, "pull");
    ADD_FAILURE() << "a model other than the server named was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not the server's"), std::string::npos) << e.what();
  }
  EXPECT_EQ(held.sha256(), weights_sha256(x0));  // still holds what it held
  wrong.clear_model_sha256();
  EXPECT_THROW(held.validate(wrong, kSpecs, int8, "pull"), Error);
  EXPECT_THROW(held.validate(set->header, kSpecs, CompressOptions{Codec::int4, 16, 0}, "pull"),
               Error);  // not the codec the task announced
}
