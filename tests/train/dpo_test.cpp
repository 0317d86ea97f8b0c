// DPO: the sigmoid, IPO and label-smoothed losses and their gradients against values computed
// here in double (and through sequence_logprobs by float64 finite differences), micro-batching,
// the reference cache, a short run that raises the held-out margin, and refused inputs.
#include "train/dpo.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "autograd/sequence_logprob.h"
#include "support/gradcheck.h"
#include "train/preference_support.h"
#include "train/preference_synth.h"

namespace fs = std::filesystem;
using namespace pollen;
namespace pt = pollen::testing;

namespace {

// Policy and reference log-probabilities of three pairs: chosen (3) then rejected (3).
const std::vector<double> kPolicy = {-4.0, -7.5, -3.2, -5.0, -6.0, -3.2};
const std::vector<double> kReference = {-4.5, -7.0, -3.0, -4.8, -6.4, -3.0};
const std::vector<int64_t> kLengths = {4, 9, 2, 5, 3, 2};

double log_sigmoid(double x) {
  return -std::log1p(std::exp(-x));
}

// The expected mean loss over the pairs, written out from the papers' formulas.
double expected_loss(const std::vector<double>& policy, const train::PreferenceLossOptions& o) {
  double total = 0;
  for (size_t i = 0; i < 3; ++i) {
    const size_t c = i, r = i + 3;
    if (o.kind == train::PreferenceLossKind::ipo) {
      const double h = (policy[c] - kReference[c]) / static_cast<double>(kLengths[c]) -
                       (policy[r] - kReference[r]) / static_cast<double>(kLengths[r]);
      total += std::pow(h - 1 / (2 * o.beta), 2);
    } else {
      const double z = o.beta * ((policy[c] - kReference[c]) - (policy[r] - kReference[r]));
      total += -(1 - o.label_smoothing) * log_sigmoid(z) - o.label_smoothing * log_sigmoid(-z);
    }
  }
  return total / 3;
}

std::vector<train::PreferenceLossOptions> all_losses() {
  return {{train::PreferenceLossKind::sigmoid, 0.5, 0.0},
          {train::PreferenceLossKind::sigmoid, 0.5, 0.2},
          {train::PreferenceLossKind::ipo, 0.5, 0.0}};
}

TEST(DpoLoss, LossAndGradientMatchHandComputedValues) {
  for (const auto& o : all_losses()) {
    SCOPED_TRACE("kind " + std::to_string(static_cast<int>(o.kind)) + " eps " +
                 std::to_string(o.label_smoothing));
    ag::Var logps(Tensor::from<double>({6}, kPolicy), true, "logps");
    ag::Tape tape;
    ag::Var loss;
    {
      ag::TapeScope scope(tape);
      loss = train::preference_loss(logps, kReference, kLengths, o, 1.0 / 3);
    }
    EXPECT_NEAR(loss.value().item(), expected_loss(kPolicy, o), 1e-12);
    tape.backward(loss);
    const std::vector<double> grad = logps.grad().to_doubles();
    for (size_t k = 0; k < kPolicy.size(); ++k) {  // central differences of the formula above
      std::vector<double> plus = kPolicy, minus = kPolicy;
      plus[k] += 1e-6;
      minus[k] -= 1e-6;
      const double numeric = (expected_loss(plus, o) - expected_loss(minus, o)) / 2e-6;
      EXPECT_NEAR(grad[k], numeric, 1e-8) << "d loss / d logps[" << k << "]";
    }
  }
  // Equal log-ratios: the sigmoid loss is log 2 for every pair whatever beta.
  const std::vector<double> same = {-1, -2, -3, -1, -2, -3};
  ag::Var logps(Tensor::from<double>({6}, same));
  EXPECT_NEAR(train::preference_loss(logps, std::vector<double>(6, 0.0), kLengths,
                                     {train::PreferenceLossKind::sigmoid, 3.0, 0.0}, 1.0 / 3)
                  .value()
                  .item(),
              std::log(2.0), 1e-15);
}

TEST(DpoLoss, MetricsAreTrlsRewards) {
  train::PreferenceStats stats;
  ag::NoGrad no_grad;
  train::preference_loss(ag::Var(Tensor::from<double>({6}, kPolicy)), kReference, kLengths,
                         {train::PreferenceLossKind::sigmoid, 0.5, 0.0}, 1.0, &stats);
  std::map<std::string, double> m;
  for (const auto& [k, v] : stats.means()) m[k] = v;
  // chosen ratios 0.5, -0.5, -0.2; rejected ratios -0.2, 0.4, -0.2.
  EXPECT_NEAR(m["rewards/chosen"], 0.5 * (0.5 - 0.5 - 0.2) / 3, 1e-12);
  EXPECT_NEAR(m["rewards/rejected"], 0.5 * (-0.2 + 0.4 - 0.2) / 3, 1e-12);
  EXPECT_NEAR(m["rewards/margins"], 0.5 * (0.7 - 0.9 + 0.0) / 3, 1e-12);
  EXPECT_NEAR(m["rewards/accuracies"], 1.0 / 3, 1e-12);
  EXPECT_EQ(stats.pairs, 3);
}

TEST(DpoLoss, GradientThroughSequenceLogprobsMatchesFiniteDifferences) {
  constexpr int64_t kPairs = 2, kT = 4, kC = 4, kV = 6;
  Rng rng(21);
  // Completions of different lengths (IPO divides by them); row 3 scores one position.
  const Tensor targets = Tensor::from<int32_t>(
      {2 * kPairs * kT},
      {-100, 1, 2, 3, -100, -100, 5, -100, 0, 4, -100, -100, -100, 2, -100, -100});
  const std::vector<double> reference = {-3.0, -2.5, -3.5, -1.0};
  for (const auto& o : all_losses()) {
    std::vector<ag::Var> leaves = {
        ag::Var(pt::random_tensor({2 * kPairs * kT, kC}, rng), true, "h"),
        ag::Var(pt::random_tensor({kV, kC}, rng), true, "w")};
    const double err = pt::max_gradcheck_error(
        [&](std::vector<ag::Var>& l) {
          const ag::Var logps = ag::sequence_logprobs(l[0], l[1], targets, 2 * kPairs);
          return train::preference_loss(logps, reference, {3, 2, 1, 1}, o, 1.0 / kPairs);
        },
        leaves);
    EXPECT_LT(err, 1e-6);
  }
}

class DpoRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = pt::unique_temp_dir(
        "dpo_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    train_ = pt::synth_pairs(dir_, "case", 48, 1);
    eval_ = pt::synth_pairs(dir_, "case", 16, 2);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string section(const std::string& extra = "") const {
    return "data = \"" + train_.string() + "\"\nvalidation = \"" + eval_.string() +
           "\"\nbeta = 0.1\nbatch_pairs = 8\nmicro_batch_pairs = 4\n" + extra;
  }
  model::Llama model() const { return pt::tiny_model(pt::chat_tokenizer().vocab_size()); }
  model::LlamaConfig config() const { return pt::tiny_config(pt::chat_tokenizer().vocab_size()); }

  fs::path dir_, train_, eval_;
};

TEST_F(DpoRun, ShortRunRaisesTheHeldOutMargin) {
  model::Llama m = model();
  train::DpoObjective dpo(pt::objective_context("dpo", section(), config()));
  const train::ObjectiveStep before = dpo.evaluate(m);
  // The policy starts as the reference: every reward is exactly zero.
  EXPECT_EQ(before.metrics["rewards/margins"].get<double>(), 0.0);
  EXPECT_NEAR(before.loss, std::log(2.0), 1e-12);
  pt::train_steps(dpo, m, 12, 3e-3);
  const train::ObjectiveStep after = dpo.evaluate(m);
  std::printf("held-out DPO after 12 steps: loss %.4f margin %.4f accuracy %.3f\n", after.loss,
              after.metrics["rewards/margins"].get<double>(),
              after.metrics["rewards/accuracies"].get<double>());
  EXPECT_GT(after.metrics["rewards/margins"].get<double>(), 0.5);
  EXPECT_GE(after.metrics["rewards/accuracies"].get<double>(), 0.8);
  EXPECT_LT(after.loss, 0.5 * std::log(2.0));
}

TEST_F(DpoRun, MicroBatchesGiveTheGradientOfTheMeanOverTheStepsPairs) {
  auto gradients = [&](int64_t micro, double* loss) {
    model::Llama m = model();
    train::DpoObjective dpo(pt::objective_context(
        "dpo",
        "data = \"" + train_.string() +
            "\"\nvalidation_fraction = 0.1\nbatch_pairs = 6\nmicro_batch_pairs = " +
            std::to_string(micro) + "\n",
        config()));
    *loss = dpo.train_step(m, 2).loss;
    std::vector<double> g;
    for (const ag::Var& p : m.parameters())
      for (double x : p.grad().to_doubles()) g.push_back(x);
    return g;
  };
  // The same six pairs in one forward pass, or in micro-batches of 4 and 2 (the padding differs,
  // so the float32 sums may differ in their last bits).
  double loss_whole = 0, loss_micro = 0;
  const auto whole = gradients(6, &loss_whole);
  const auto micro = gradients(4, &loss_micro);
  ASSERT_EQ(whole.size(), micro.size());
  double scale = 0;
  for (double x : whole) scale = std::max(scale, std::fabs(x));
  ASSERT_GT(scale, 0);
  for (size_t i = 0; i < whole.size(); ++i) ASSERT_NEAR(micro[i], whole[i], 1e-5 * scale) << i;
  EXPECT_NEAR(loss_micro, loss_whole, 1e-5);
}

TEST_F(DpoRun, ReferencesAreCachedInTheRunFolderAndReadOnResume) {
  const fs::path run = dir_ / "run";
  model::Llama m = model();
  train::DpoObjective first(pt::objective_context("dpo", section(), config(), run));
  pt::train_steps(first, m, 2, 3e-3);
  const nlohmann::ordered_json state = first.state();
  const std::string file = state["reference_cache"].get<std::string>();
  ASSERT_TRUE(fs::exists(run / file)) << file;
  const train::ReferenceLogps expected = first.references(m);

  // A resumed objective reads the starting model's references, not the trained model's.
  train::DpoObjective resumed(pt::objective_context("dpo", section(), config(), run));
  resumed.restore(state);
  EXPECT_EQ(resumed.references(m).train, expected.train);
  EXPECT_EQ(resumed.references(m).eval, expected.eval);
  train::DpoObjective fresh(pt::objective_context("dpo", section(), config()));
  EXPECT_NE(fresh.references(m).train, expected.train);  // the trained model's differ

  // The same weights under another architecture (rope_theta) score differently: another cache.
  model::LlamaConfig wider_rope = config();
  wider_rope.rope_theta *= 4;
  const model::Llama start = model(), same_weights(wider_rope, 7);
  const auto from = start.named_parameters(), to = same_weights.named_parameters();
  for (size_t i = 0; i < from.size(); ++i) {
    ag::Var w = to[i].second;
    w.value().copy_(from[i].second.value());
  }
  train::DpoObjective a(pt::objective_context("dpo", section(), config(), dir_ / "rope"));
  train::DpoObjective b(pt::objective_context("dpo", section(), wider_rope, dir_ / "rope"));
  a.references(start);
  b.references(same_weights);
  EXPECT_NE(a.state()["reference_cache"], b.state()["reference_cache"]);

  // Other data under the same run is refused naming the run's data files, and so is a cache
  // that holds another data's references (a checkpoint written before the state held its key).
  const fs::path other = pt::synth_pairs(dir_, "case", 48, 9);
  train::DpoObjective changed(pt::objective_context(
      "dpo", "data = \"" + other.string() + "\"\nvalidation = \"" + eval_.string() + "\"\n",
      config(), run));
  const auto refusal = [&](const nlohmann::ordered_json& st) {
    try {
      changed.restore(st);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string named = refusal(state);
  EXPECT_NE(named.find("dpo: cannot resume: dpo.data '" + other.string() + "' ("),
            std::string::npos)
      << named;
  EXPECT_NE(named.find(" then, "), std::string::npos) << named;
  EXPECT_EQ(named.find("dpo.validation"), std::string::npos) << named;  // it did not change
  nlohmann::ordered_json unnamed = state;  // written before checkpoints recorded the parts
  unnamed.erase("data_parts");
  const std::string told = refusal(unnamed);
  EXPECT_NE(told.find("dpo: cannot resume: the data (dpo.data '" + other.string() +
                      "', dpo.validation '" + eval_.string() + "')"),
            std::string::npos)
      << told;
  nlohmann::ordered_json older = state;
  older.erase("data_key");
  const std::string cached = refusal(older);
  EXPECT_NE(cached.find("changed since the run started"), std::string::npos) << cached;
}

TEST_F(DpoRun, BadConfigAndDataAreRefusedByName) {
  auto error = [&](const std::string& toml) {
    try {
      train::DpoObjective d(pt::objective_context("dpo", toml, config()));
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error(section("betta = 0.2")).find("betta"), std::string::npos);
  EXPECT_NE(error(section("loss = \"hinge\"")).find("\"sigmoid\" or \"ipo\""), std::string::npos);
  EXPECT_NE(error(section("loss = \"ipo\"\nlabel_smoothing = 0.1")).find("label_smoothing"),
            std::string::npos);
  EXPECT_NE(error(section("label_smoothing = 0.7")).find("[0, 0.5)"), std::string::npos);
  EXPECT_NE(error("data = \"" + train_.string() + "\"\n").find("set exactly one"),
            std::string::npos);
  const fs::path bad = dir_ / "bad.jsonl";
  std::ofstream(bad) << "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n"
                     << "{\"prompt\": \"a\", \"chosen\": \"b\"}\n";
  const std::string missing = error("data = \"" + bad.string() + "\"\nvalidation_fraction = 0.5\n");
  EXPECT_NE(missing.find("line 2"), std::string::npos) << missing;
  EXPECT_NE(missing.find("'rejected'"), std::string::npos) << missing;
  std::ofstream(bad) << "{\"prompt\": [{\"role\": \"user\"}], \"chosen\": \"b\", \"rejected\": "
                        "\"c\"}\n";
  const std::string no_content =
      error("data = \"" + bad.string() + "\"\nvalidation_fraction = 0.5\n");
  EXPECT_NE(no_content.find("line 1, field 'prompt[0].content' is missing"), std::string::npos)
      << no_content;
}

TEST_F(DpoRun, UnderLoraTheReferenceIsTheFrozenBase) {
  // Adapters with a random non-zero B: the policy differs from the base, the reference does not.
  model::Llama adapted = model();
  pt::attach_random_lora(
      adapted, {model::LoraTarget::q_proj, model::LoraTarget::v_proj, model::LoraTarget::down_proj},
      17);
  train::DpoObjective under_lora(pt::objective_context("dpo", section(), config()));
  train::DpoObjective plain(pt::objective_context("dpo", section(), config()));
  const model::Llama base = model();
  EXPECT_EQ(under_lora.references(adapted).train, plain.references(base).train);
  EXPECT_EQ(under_lora.references(adapted).eval, plain.references(base).eval);
  const train::ObjectiveStep step = under_lora.evaluate(adapted);
  EXPECT_GT(std::fabs(step.metrics["rewards/chosen"].get<double>()), 1e-4);  // policy != base
}

// An adapter on lm_head alone moves the policy too: the head's scale * B A is part of the model
// whose log-probabilities DPO compares with the reference's.
TEST_F(DpoRun, AnAdapterOnTheHeadMovesThePolicy) {
  model::Llama adapted = model();
  pt::attach_random_lora(adapted, {model::LoraTarget::lm_head}, 17);
  train::DpoObjective dpo(pt::objective_context("dpo", section(), config()));
  const train::ObjectiveStep step = dpo.evaluate(adapted);
  EXPECT_GT(std::fabs(step.metrics["rewards/chosen"].get<double>()), 1e-4);  // policy != base
}

// `dpo synth --digits 1`: right and wrong sums of one-digit numbers (the SFT example's task).
TEST(DpoSynth, ArithmeticOperandsHaveAtMostTheGivenDigits) {
  const fs::path file = pt::unique_temp_dir("dpo_synth") / "pairs.jsonl";
  train::PreferenceSynthOptions o;
  o.count = 200;
  o.seed = 3;
  o.digits = 1;
  train::write_preference_synth(o, file);
  std::ifstream in(file);
  std::string line;
  int pairs = 0, largest = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    int a = 0, b = 0;
    char op = 0;
    const std::string prompt = j["prompt"][0]["content"];
    ASSERT_EQ(std::sscanf(prompt.c_str(), "What is %d %c %d?", &a, &op, &b), 3) << prompt;
    const std::string expr = prompt.substr(8, prompt.size() - 9);
    EXPECT_EQ(j["chosen"], expr + " = " + std::to_string(op == '+' ? a + b : a - b) + ".");
    EXPECT_NE(j["rejected"], j["chosen"]);
    largest = std::max({largest, a, b});
    ++pairs;
  }
  EXPECT_EQ(pairs, 200);
  EXPECT_EQ(largest, 9);
  fs::remove_all(file.parent_path());
}

}  // namespace
