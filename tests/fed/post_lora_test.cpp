// Federated post-training with LoRA adapters: a simulated round of three SFT silos gives the
// model that averaging the silos' merged updates gives (A shared and frozen, B averaged); only
// the adapters' B travel; a silo whose adapters differ is refused naming the difference.
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "fed/post_lora.h"
#include "io/model_source.h"
#include "ops/elementwise.h"
#include "train/grpo.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/preference_synth.h"
#include "train/reward.h"
#include "train/sft.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

struct Fixture {
  fs::path dir, tokenizer_path, model_file;
  std::vector<fs::path> data;  // one file per silo, of different tasks
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x;
    x.dir = test_support::post_temp_dir("fed-lora");
    x.tokenizer_path = test_support::make_chat_tokenizer(x.dir);
    x.model_file = test_support::make_tiny_model_file(x.dir);
    int seed = 1;
    for (const char* task : {"arithmetic", "reverse", "upper"})
      x.data.push_back(
          test_support::write_sft_data(x.dir / (std::string(task) + ".jsonl"), task, 40, seed++));
    return x;
  }();
  return f;
}

const char* kLora =
    "\n[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\", \"o_proj\", "
    "\"down_proj\", \"lm_head\"]\ntrain_a = false\nseed = 11\n";

train::PostConfig silo_config(size_t silo, const std::vector<std::string>& sets = {}) {
  const auto& fx = fixture();
  const std::string text =
      test_support::tiny_post_toml(fx.dir / ("silo" + std::to_string(silo)), fx.model_file,
                                   fx.tokenizer_path, 100,
                                   "[sft]\ndata = \"" + fx.data[silo].string() +
                                       "\"\nseq = 64\nmicro_batch = 2\nvalidation_fraction = 0\n") +
      kLora;
  return train::parse_post_config(text, "silo.toml", "sft", sets);
}

std::vector<std::unique_ptr<fed::LoraSilo>> make_silos() {
  std::vector<std::unique_ptr<fed::LoraSilo>> silos;
  for (size_t i = 0; i < 3; ++i)
    silos.push_back(std::make_unique<fed::LoraSilo>("silo-" + std::to_string(i), silo_config(i),
                                                    train::make_sft_objective));
  return silos;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(FedPostLora, RoundEqualsTheMeanOfTheSilosMergedUpdatesAndSendsOnlyB) {
  auto silos = make_silos();
  const model::Llama& base = silos[0]->model();
  fed::LoraFedOptions o;
  o.local_steps = 3;  // fedavg, lr 1: the new global B is the token-weighted mean of the local B
  fed::LoraFederation server(base.config(), silos[0]->lora_config(), "sft", 0, o);
  std::vector<fed::LoraSilo*> ptrs;
  for (auto& s : silos) {
    server.admit(*s);
    ptrs.push_back(s.get());
  }
  const fed::LoraRoundSummary sum = server.run_round(1, ptrs);

  // The reference: the base plus the token-weighted mean of the silos' merged updates
  // scale * B_i A, each silo's B_i as it ended the round.
  std::vector<const model::Lora*> locals;
  std::vector<double> weights;
  for (auto& s : silos) {
    locals.push_back(&s->lora());
    weights.push_back(static_cast<double>(sum.client_tokens.at(s->id())));
    EXPECT_GT(weights.back(), 0);
  }
  std::map<std::string, Tensor> reference;
  for (const auto& [name, v] : base.named_parameters()) reference[name] = v.value().clone();
  const auto updates = model::average_merged_updates(locals, weights);
  EXPECT_EQ(updates.size(), 2u * 4u + 1u);  // 2 layers x 4 targets, the head
  for (const auto& [name, d] : updates) ops::axpy(1.0, d, reference.at(name));

  // The global model by the rule: the base with the aggregated adapters merged in.
  const model::Llama merged = model::merge_lora(base, server.global().lora());
  double worst = 0, largest_update = 0;
  for (const auto& [name, v] : merged.named_parameters()) {
    const auto x = v.value().to_doubles(), y = reference.at(name).to_doubles();
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(x[i] - y[i]));
  }
  for (const auto& [name, d] : updates)
    for (double u : d.to_doubles()) largest_update = std::max(largest_update, std::fabs(u));
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(largest_update, 1e-4);  // the silos did move, so the comparison means something

  // Averaging each silo's own A and B separately would not give it: the rule needs A shared.
  // (tests/model/lora_test.cpp shows that case; here every silo's A is the federation's.)
  for (const auto& [name, v] : silos[1]->lora().named_tensors()) {
    if (!name.ends_with("lora_A.weight")) continue;
    for (const auto& [gname, gv] : server.global().lora().named_tensors())
      if (gname == name) {
        EXPECT_EQ(v.value().to_doubles(), gv.value().to_doubles()) << name;
      }
  }

  // Only B travels: 3 silos x B's float32 bytes each way, far less than the model.
  int64_t b_values = 0, model_values = 0;
  for (const auto& spec : server.specs()) {
    EXPECT_NE(spec.name.find("lora_B"), std::string::npos) << spec.name;
    b_values += shape_numel(spec.shape);
  }
  for (const auto& [name, v] : base.named_parameters()) model_values += v.value().numel();
  EXPECT_EQ(sum.bytes_received, static_cast<uint64_t>(3 * 4 * b_values));
  EXPECT_EQ(sum.bytes_sent, static_cast<uint64_t>(3 * 4 * b_values));
  EXPECT_LT(b_values * 10, model_values);
}

TEST(FedPostLora, RoundsLowerTheSilosLoss) {
  std::vector<std::unique_ptr<fed::LoraSilo>> silos;
  for (size_t i = 0; i < 3; ++i)
    silos.push_back(std::make_unique<fed::LoraSilo>("silo-" + std::to_string(i),
                                                    silo_config(i, {"optimizer.lr=0.02"}),
                                                    train::make_sft_objective));
  fed::LoraFedOptions o;
  o.local_steps = 4;
  fed::LoraFederation server(silos[0]->model().config(), silos[0]->lora_config(), "sft", 0, o);
  std::vector<fed::LoraSilo*> ptrs;
  for (auto& s : silos) ptrs.push_back(s.get());
  const double first = server.run_round(1, ptrs).train_loss;
  double last = first;
  for (int64_t r = 2; r <= 4; ++r) last = server.run_round(r, ptrs).train_loss;
  EXPECT_LT(last, 0.9 * first);
}

// GRPO federates like SFT: a federation of one GRPO silo at FedAvg lr 1, 2 rounds of 2 local
// steps, ends with the adapters that 4 steps of the same silo alone give (its rollouts are
// functions of the seed and the step, its AdamW state and the KL reference, the base, carry
// across rounds), to float rounding, and reports the rewards it trained on. The untrained model
// never answers a sum, so the reward is a vowel anywhere in the completion: the groups' rewards
// differ and the steps train.
TEST(FedPostLora, OneGrpoSiloFederatedEqualsItsLocalTraining) {
  const auto& fx = fixture();
  const fs::path prompts = fx.dir / "grpo-prompts.jsonl";
  {
    std::ofstream out(prompts);
    for (const auto& e : train::synth_examples("arithmetic", 16, 5))
      out << train::grpo_jsonl_line(e) << "\n";
  }
  const std::string section = "[grpo]\ndata = \"" + prompts.string() +
                              "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\n"
                              "max_completion_tokens = 6\nbeta = 0.04\n\n[grpo.verifier]\n"
                              "kind = \"regex\"\npattern = \"[aeiou]\"\n";
  auto silo = [&](const std::string& name) {
    const train::PostConfig c =
        train::parse_post_config(test_support::tiny_post_toml(fx.dir / name, fx.model_file,
                                                              fx.tokenizer_path, 100, section) +
                                     kLora,
                                 "grpo.toml", "grpo", {"optimizer.lr=0.05"});
    return std::make_unique<fed::LoraSilo>(name, c,
                                           fed::lora_objective_factory("grpo", "test", c.base));
  };
  auto federated = silo("grpo-federated");
  fed::LoraFedOptions o;
  o.local_steps = 2;
  fed::LoraFederation server(federated->model().config(), federated->lora_config(), "grpo",
                             federated->seed(), o);
  server.admit(*federated);
  double rewards = 0;  // the rounds' mean rewards, each over its 2 steps
  for (int64_t r = 1; r <= 2; ++r) {
    const fed::LoraRoundSummary sum = server.run_round(r, {federated.get()});
    EXPECT_GT(sum.tokens, 0);
    EXPECT_EQ(sum.headline, "reward");
    rewards += sum.client_metrics.at("grpo-federated").at("reward");
  }

  auto alone = silo("grpo-alone");
  const auto local = alone->train(4);
  // The same rollouts, scored alike: the rounds' rewards are the local steps'.
  EXPECT_DOUBLE_EQ(rewards / 2, local.metrics.at("reward"));
  const fed::Weights mine = fed::lora_weights(server.global().lora()),
                     theirs = fed::lora_weights(alone->lora());
  ASSERT_EQ(mine.size(), theirs.size());
  double worst = 0, largest = 0;
  for (size_t i = 0; i < mine.size(); ++i) {
    const auto x = mine[i].to_doubles(), y = theirs[i].to_doubles();
    for (size_t j = 0; j < x.size(); ++j) {
      worst = std::max(worst, std::fabs(x[j] - y[j]));
      largest = std::max(largest, std::fabs(y[j]));
    }
  }
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(largest, 1e-3);  // B left zero: the steps did train
}

// A reward model's score head is the objective's own parameter: it starts on the server as the
// silo's objective draws it (from the run file's seed), trains with B and travels beside it. A
// federation of one silo at FedAvg lr 1, 2 rounds of 2 local steps, ends with the adapters and the
// head that 4 steps of the same silo alone give, and exports the reward model of the merged base
// and that head.
TEST(FedPostLora, OneRewardModelSiloFederatedEqualsItsLocalTraining) {
  const auto& fx = fixture();
  train::PreferenceSynthOptions pairs;
  pairs.task = "case";
  pairs.count = 24;
  const fs::path data = fx.dir / "rm-pairs.jsonl";
  train::write_preference_synth(pairs, data);
  const std::string section = "[rm]\ndata = \"" + data.string() +
                              "\"\nvalidation_fraction = 0.25\nbatch_pairs = 4\n"
                              "micro_batch_pairs = 4\n";
  auto silo = [&](const std::string& name) {
    const train::PostConfig c =
        train::parse_post_config(test_support::tiny_post_toml(fx.dir / name, fx.model_file,
                                                              fx.tokenizer_path, 100, section) +
                                     kLora,
                                 "rm.toml", "rm", {"optimizer.lr=0.05"});
    return std::make_unique<fed::LoraSilo>(name, c, fed::lora_objective_factory("rm", "test"));
  };
  auto federated = silo("rm-federated");
  const fed::ParamSpecs specs = federated->exchanged_specs();
  ASSERT_EQ(specs.back().name, "score.weight");
  EXPECT_EQ(specs.back().shape, (Shape{1, federated->model().config().hidden_size}));
  fed::LoraFedOptions o;
  o.local_steps = 2;
  fed::LoraFederation server(federated->model().config(), federated->lora_config(), "rm",
                             federated->seed(), o);
  ASSERT_EQ(server.specs().size(), specs.size());
  // The server's head is the one the silo's objective drew.
  EXPECT_TRUE(server.global().objective_params()[0].to_doubles() ==
              federated->exchanged_weights().back().to_doubles());
  server.admit(*federated);
  for (int64_t r = 1; r <= 2; ++r) server.run_round(r, {federated.get()});

  auto alone = silo("rm-alone");
  alone->train(4);
  const fed::Weights mine = server.global().weights(), theirs = alone->exchanged_weights();
  ASSERT_EQ(mine.size(), theirs.size());
  double worst = 0, head_moved = 0;
  for (size_t i = 0; i < mine.size(); ++i) {
    const auto x = mine[i].to_doubles(), y = theirs[i].to_doubles();
    for (size_t j = 0; j < x.size(); ++j) worst = std::max(worst, std::fabs(x[j] - y[j]));
  }
  const auto start = server.global().objective_params()[0].to_doubles();
  const auto initial = silo("rm-initial")->exchanged_weights().back().to_doubles();
  for (size_t j = 0; j < start.size(); ++j)
    head_moved = std::max(head_moved, std::fabs(start[j] - initial[j]));
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(head_moved, 1e-3);  // the head trained

  // The export: the base with the global adapters merged, and the global head.
  const fs::path out = fx.dir / "rm-export";
  fed::export_federated_reward_model(federated->config(), server.global(), out);
  const train::RewardModel rm = train::load_reward_model(out);
  EXPECT_TRUE(rm.score.value().to_doubles() == start);
  const train::PostBase base = train::resolve_post_base(federated->config());
  EXPECT_EQ(rm.pad_token_id, train::pad_token_named(*base.tokenizer, "<|endoftext|>", "test"));
  const model::Llama merged = model::merge_lora(
      io::load_model(base.source, DType::f32, federated->seed()), server.global().lora());
  // The decoder's tensors (a sequence classifier has no lm_head).
  std::map<std::string, std::vector<double>> expected;
  for (const auto& [name, v] : merged.named_parameters())
    if (name.starts_with("model.")) expected[name] = v.value().to_doubles();
  size_t compared = 0;
  for (const auto& [name, v] : rm.decoder->named_parameters()) {
    if (!name.starts_with("model.")) continue;
    ASSERT_TRUE(expected.contains(name)) << name;
    EXPECT_TRUE(v.value().to_doubles() == expected[name]) << name;
    ++compared;
  }
  EXPECT_EQ(compared, expected.size());
}

TEST(FedPostLora, SilosWithOtherAdaptersAreRefusedNamingTheDifference) {
  const auto silos = make_silos();
  fed::LoraFederation server(silos[0]->model().config(), silos[0]->lora_config(), "sft", 0, {});
  const fed::LoraSilo rank8("silo-r", silo_config(0, {"lora.rank=8"}), train::make_sft_objective);
  EXPECT_NE(error_of([&] { server.admit(rank8); }).find("lora.rank: server 4, client 8"),
            std::string::npos);
  const fed::LoraSilo targets("silo-t", silo_config(0, {"lora.target_modules=[\"q_proj\"]"}),
                              train::make_sft_objective);
  const std::string e = error_of([&] { server.admit(targets); });
  EXPECT_NE(
      e.find("lora.target_modules: server [q_proj, v_proj, o_proj, down_proj, lm_head], client "
             "[q_proj]"),
      std::string::npos)
      << e;
  EXPECT_NE(e.find("silo-t"), std::string::npos);
  // A that trains cannot be averaged exactly: refused when the silo is made.
  EXPECT_NE(error_of([&] {
              fed::LoraSilo("silo-a", silo_config(0, {"lora.train_a=true"}),
                            train::make_sft_objective);
            }).find("lora.train_a"),
            std::string::npos);
}

}  // namespace
