// A federated silo on the GPU (train.device = "cuda"): a simulation whose clients train on the
// GPU follows the same simulation on the CPU, with everything a client does to its weights and
// its inner AdamW between steps and rounds switched on: drift correction, the proximal term, the
// shared first and second moments, and client states written after every round and resumed.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda/gpu_compare.h"
#include "fed/client.h"
#include "fed/fixtures.h"
#include "fed/run.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

// Two silos of other data, `rounds` rounds of 4 local steps of DiLoCo, on `device`; `pulls`:
// with drift correction and the proximal term.
SimConfig simulation(const fs::path& dir, const std::vector<fs::path>& silos,
                     const std::string& device, int64_t rounds = 3, bool pulls = true) {
  SimConfig c = sim_config(dir, silos, "diloco", rounds, 4);
  // One head of 32: the GPU's attention takes head dimensions 32, 64 and 128.
  c.server.model.num_attention_heads = 1;
  c.server.model.num_key_value_heads = 1;
  c.server.model.validate();
  c.server.strategy.first_moments = "output";
  c.server.strategy.second_moments = "factored";
  for (auto& cc : c.clients) {
    cc.model = c.server.model;
    cc.train.device = device;
    cc.train.drift_correction = pulls ? 0.5 : 0.0;
    cc.train.proximal_mu = pulls ? 1.0 : 0.0;
    cc.state_dir = dir / ("state-" + cc.id);
  }
  return c;
}

// ||a - b|| / ||b||.
double relative_error(const Weights& a, const Weights& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (int64_t j = 0; j < a[i].numel(); ++j) {
      const double x = a[i].data<float>()[j], y = b[i].data<float>()[j];
      diff += (x - y) * (x - y);
      norm += y * y;
    }
  }
  return std::sqrt(diff / norm);
}

Weights minus(const Weights& a, const Weights& b) {
  Weights out;
  for (size_t i = 0; i < a.size(); ++i) {
    Tensor t = Tensor::empty(a[i].shape(), DType::f32);
    for (int64_t j = 0; j < t.numel(); ++j)
      t.data<float>()[j] = a[i].data<float>()[j] - b[i].data<float>()[j];
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

TEST(CudaFedClient, ASimulationOnTheGpuFollowsTheCpus) {
  POLLEN_REQUIRE_GPU();
  const fs::path dir = temp_dir("cuda_sim");
  const std::vector<fs::path> silos = {make_silo(dir / "a", 1), make_silo(dir / "b", 3)};
  const SimulationResult cpu = run_simulation(simulation(dir / "cpu", silos, "cpu"), false);
  const SimulationResult gpu = run_simulation(simulation(dir / "gpu", silos, "cuda"), false);
  ASSERT_EQ(cpu.rounds, 3);
  ASSERT_EQ(gpu.rounds, 3);

  // What the federation learnt (the global model minus its start) agrees to 1%: float32
  // roundings apart, where a step the GPU client missed (a drift, a proximal pull, moments not
  // set back) moves it by far more.
  const model::LlamaConfig m = simulation(dir / "start", silos, "cpu").server.model;
  const Weights start = model_weights(model::Llama(m, 5));
  ASSERT_FALSE(bitwise_equal(cpu.global, start));
  EXPECT_LT(relative_error(minus(gpu.global, start), minus(cpu.global, start)), 1e-2);
  ASSERT_EQ(gpu.eval_loss.size(), cpu.eval_loss.size());
  for (size_t i = 0; i < cpu.eval_loss.size(); ++i)
    EXPECT_NEAR(gpu.eval_loss[i], cpu.eval_loss[i], 1e-3 * cpu.eval_loss[i]) << cpu.clients[i];
  // The bound catches a client that skips a step's pull: without drift correction and the
  // proximal term the GPU run ends further than that from the CPU's.
  const SimulationResult plain =
      run_simulation(simulation(dir / "plain", silos, "cuda", 3, false), false);
  EXPECT_GT(relative_error(minus(plain.global, start), minus(cpu.global, start)), 1e-2);

  // Each client kept its state on disk after every round; stopped after round 2 and resumed,
  // the GPU clients load theirs back into GPU memory and end where the uninterrupted run does.
  for (const auto& id : gpu.clients)
    EXPECT_TRUE(fs::exists(dir / "gpu" / ("state-" + id) / "checkpoints")) << id;
  ASSERT_EQ(run_simulation(simulation(dir / "cut", silos, "cuda", 2), false).rounds, 2);
  const SimulationResult resumed = run_simulation(simulation(dir / "cut", silos, "cuda"), true);
  ASSERT_EQ(resumed.rounds, 3);
  EXPECT_LT(relative_error(minus(resumed.global, start), minus(gpu.global, start)), 1e-6);
  fs::remove_all(dir);
}

// train.precision = "bf16": the model computes with bf16 copies and the silo exchanges and saves
// AdamW's f32 master weights, so the federation trains as the f32 CPU federation does, within
// bf16's rounding, and its global model is not rounded to bf16.
TEST(CudaFedClient, Bf16SilosExchangeTheirF32MasterWeights) {
  POLLEN_REQUIRE_GPU();
  const fs::path dir = temp_dir("cuda_sim_bf16");
  const std::vector<fs::path> silos = {make_silo(dir / "a", 1), make_silo(dir / "b", 3)};
  const SimulationResult cpu = run_simulation(simulation(dir / "cpu", silos, "cpu"), false);
  SimConfig bf16 = simulation(dir / "bf16", silos, "cuda");
  for (auto& cc : bf16.clients) cc.train.precision = "bf16";
  const SimulationResult gpu = run_simulation(bf16, false);
  ASSERT_EQ(gpu.rounds, 3);

  // The fresh model's loss on each silo, and how far each federation took it down.
  SimConfig fresh = simulation(dir / "fresh", silos, "cpu");
  for (size_t i = 0; i < cpu.eval_loss.size(); ++i) {
    LocalTrainer start(fresh.clients[i]);
    start.set_exchanged_weights(model_weights(model::Llama(fresh.server.model, 5)));
    int64_t tokens = 0;
    const double initial = start.evaluate(&tokens);
    EXPECT_GT(initial - gpu.eval_loss[i], 0.5 * (initial - cpu.eval_loss[i])) << cpu.clients[i];
    EXPECT_NEAR(gpu.eval_loss[i], cpu.eval_loss[i], 2e-2 * cpu.eval_loss[i]) << cpu.clients[i];
  }
  // Masters, not copies: most global values are not bf16 numbers, and neither are the saved ones.
  const auto share_off_bf16 = [](const Weights& w) {
    int64_t off = 0, all = 0;
    for (const Tensor& t : w) {
      const auto x = t.to_doubles(), rounded = t.to(DType::bf16).to_doubles();
      for (size_t j = 0; j < x.size(); ++j) off += x[j] != rounded[j];
      all += t.numel();
    }
    return static_cast<double>(off) / static_cast<double>(all);
  };
  EXPECT_GT(share_off_bf16(gpu.global), 0.5);
  const fs::path states = dir / "bf16" / ("state-" + gpu.clients[0]) / "checkpoints";
  ASSERT_TRUE(fs::exists(states));
  fs::path newest;
  for (const auto& e : fs::directory_iterator(states))
    if (e.is_directory() && e.path().filename().string().starts_with("step-"))
      newest = std::max(newest, e.path());
  EXPECT_GT(share_off_bf16(read_model(newest)), 0.5);
  fs::remove_all(dir);
}
