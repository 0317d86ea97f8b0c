// Data parallel inside a silo: the loader's split by rank, bucket planning, and `pollen train`
// run as 1, 2 and 3 ranks under mpirun (oversubscribed on a small machine): the same losses as
// one process, ZeRO-1 holding 1/N of the optimizer state, resume at another world size, and a
// killed or hung rank ending the job with an error that names it.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "autograd/tape.h"
#include "data/loader.h"
#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "dist/launch.h"
#include "dist/nccl.h"
#include "dist/nccl_communicator.h"
#include "dist/same_inputs.h"
#include "dist/topology.h"
#include "dist/zero_adamw.h"
#include "io/checkpoint.h"
#include "ops/elementwise.h"
#include "support/process.h"
#include "train/tiny_run.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

// The mpiruns a test process starts (this layer's tests, every file) keep their session files in
// a folder of that process's own: each OpenMPI launcher creates /tmp/ompi.<host>.<uid> as it
// starts, and two starting at once (ctest -j) can fail on it ("A call to mkdir was unable to
// create the desired directory ... File exists").
struct OwnMpiSessionFolder {
  fs::path dir = fs::temp_directory_path() / ("pollen_ompi_" + std::to_string(getpid()));
  OwnMpiSessionFolder() {
    fs::create_directories(dir);
    setenv("OMPI_MCA_orte_tmpdir_base", dir.c_str(), 0);
  }
  ~OwnMpiSessionFolder() {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
  }
} const own_mpi_session_folder;

fs::path temp_dir(const std::string& name) {
  return test_support::fresh_temp_dir("dist_" + name);
}

const fs::path& dataset() {
  static const fs::path m = test_support::make_tiny_dataset(temp_dir("data"));
  return m;
}

// 12 rows of 16 tokens per step: 6, 3 or 2 micro-steps of 2 rows per rank at 1, 2 or 3 ranks.
fs::path write_run(const fs::path& dir, int steps, const std::string& parallel = "") {
  std::string toml = test_support::tiny_run_toml(dir / "run", dataset(), steps,
                                                 "\n[parallel]\ntimeout_s = 60\n" + parallel);
  const std::string from = "micro_batch = 4\nseq = 16\nbatch_tokens = 128";
  toml.replace(toml.find(from), from.size(), "micro_batch = 2\nseq = 16\nbatch_tokens = 192");
  const std::string threads = "threads = 2";
  toml.replace(toml.find(threads), threads.size(), "threads = 1");
  write_file_atomic(dir / "run.toml", toml);
  return dir / "run.toml";
}

struct Outcome {
  int exit_code = -1;
  std::string output;
};

// `pollen train` as `ranks` processes under mpirun (1: no mpirun at all), with an environment
// prefix such as "POLLEN_FAULT_INJECT=kill:1:5".
Outcome train(int ranks, const fs::path& config, const std::string& extra = "",
              const std::string& env = "") {
  std::string cmd = env.empty() ? "" : "env " + env + " ";
  if (ranks > 1) {
    cmd += "mpirun --oversubscribe --bind-to none -np " + std::to_string(ranks) + " ";
    if (geteuid() == 0) cmd += "--allow-run-as-root ";
    cmd += "-x POLLEN_FAULT_INJECT ";
  }
  cmd += std::string(POLLEN_BINARY) + " train --config " + config.string() + " " + extra + " 2>&1";
  Outcome o;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) o.output.append(buf, n);
  const int status = pclose(p);
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return o;
}

std::vector<nlohmann::json> records(const fs::path& run, const char* key) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out.push_back(j);
  }
  return out;
}

std::vector<double> train_losses(const fs::path& run) {
  std::vector<double> out;
  for (const auto& j : records(run, "loss")) out.push_back(j["loss"].get<double>());
  return out;
}

nlohmann::json summary(const fs::path& run) {
  std::ifstream in(run / "summary.json");
  return nlohmann::json::parse(in);
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], tol * std::max(1.0, std::abs(b[i]))) << what << " at step " << i + 1;
}

// One process, 8 steps: the reference every job is held to.
const std::vector<double>& reference_losses() {
  static const std::vector<double> losses = [] {
    const fs::path d = temp_dir("reference");
    const Outcome o = train(1, write_run(d, 8));
    EXPECT_EQ(o.exit_code, 0) << o.output;
    return train_losses(d / "run");
  }();
  return losses;
}

// A communicator whose collectives do nothing: the fakes below override what they test.
class FakeComm : public dist::Communicator {
 public:
  explicit FakeComm(dist::Topology t) : Communicator(std::move(t)) {}
  dist::Request start_all_reduce(float*, int64_t, std::string) override { return 0; }
  dist::Request start_reduce_scatter(const float*, float*, int64_t, std::string) override {
    return 0;
  }
  dist::Request start_all_gather(const float*, float*, int64_t, std::string) override { return 0; }
  dist::Request start_broadcast(float*, int64_t, int, std::string) override { return 0; }
  void progress() override {}
  double wait(dist::Request) override { return 0; }
  void all_reduce_sum(std::span<double>, std::string) override {}
  void broadcast(std::span<int64_t>, int, std::string) override {}
  void wait_for_broadcast(std::span<int64_t>, int, std::string) override {}
  [[noreturn]] void abort_job(int) override { std::abort(); }
};

// One rank that records when reductions start: the tape's steps left at each start.
class RecordingComm final : public FakeComm {
 public:
  RecordingComm() : FakeComm(dist::Topology{}) {}
  const ag::Tape* tape = nullptr;
  std::vector<size_t> tape_left_at_start;
  dist::Request start_all_reduce(float*, int64_t, std::string) override { return record(); }
  dist::Request start_reduce_scatter(const float* in, float* out, int64_t n, std::string) override {
    std::copy(in, in + n, out);
    return record();
  }
  dist::Request start_all_gather(const float* in, float* out, int64_t n, std::string) override {
    std::copy(in, in + n, out);
    return 0;
  }

 private:
  dist::Request record() {
    tape_left_at_start.push_back(tape ? tape->size() : 0);
    return 0;
  }
};

// Rank 1 of 2, alone: an all-gather puts this rank's block after rank 0's, which reads -1.
class SecondOfTwoComm final : public FakeComm {
 public:
  SecondOfTwoComm() : FakeComm(dist::Topology{1, 2, 1, 2, "none"}) {}
  int all_gathers = 0;
  dist::Request start_all_gather(const float* in, float* out, int64_t n, std::string) override {
    std::fill(out, out + n, -1.0f);
    std::copy(in, in + n, out + n);
    ++all_gathers;
    return 0;
  }
};

struct TinyModel {
  model::Llama model;
  std::vector<ag::Var> params;
  model::Batch batch;
  TinyModel() : model(config(), 5) {
    for (const auto& [n, v] : model.named_parameters()) params.push_back(v);
    data::LoaderOptions lo;
    lo.manifests = {dataset()};
    lo.batch = 2;
    lo.seq = 16;
    data::Loader loader(lo);
    batch = loader.next();
  }
  static model::LlamaConfig config() {
    model::LlamaConfig c;
    c.vocab_size = 64;
    c.hidden_size = 32;
    c.intermediate_size = 64;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.max_position_embeddings = 64;
    return c;
  }
  // One backward, observed by `observer` when given; the tape is shown to `comm`.
  void backward(RecordingComm* comm, ag::BackwardObserver* observer) {
    ag::Tape tape;
    ag::Var l;
    {
      ag::TapeScope scope(tape);
      l = model.loss(batch, ag::Reduction::sum);
    }
    if (comm) comm->tape = &tape;
    if (observer) {
      ag::ObserveBackward observe(*observer);
      tape.backward(l, 0.01);
    } else {
      tape.backward(l, 0.01);
    }
    if (comm) comm->tape = nullptr;
  }
  std::vector<std::vector<float>> grads() const {
    std::vector<std::vector<float>> out;
    for (const auto& p : params) {
      const float* g = p.grad().contiguous().data<float>();
      out.emplace_back(g, g + p.grad().numel());
    }
    return out;
  }
};

}  // namespace

TEST(GradReducer, StartsBucketsWhileBackwardRunsAndHandsBackTheGradients) {
  TinyModel m;
  m.backward(nullptr, nullptr);
  const auto expected = m.grads();
  for (auto& p : m.params) p.zero_grad();

  RecordingComm comm;
  dist::GradReducer reducer(comm, m.params, 4096, dist::ReduceMode::all_reduce);
  ASSERT_GE(reducer.buckets().size(), 4u);
  // The first step learns each parameter's number of gradient writes: it reduces afterwards.
  m.backward(&comm, &reducer);
  EXPECT_TRUE(comm.tape_left_at_start.empty());
  reducer.finish();
  EXPECT_EQ(comm.tape_left_at_start.size(), reducer.buckets().size());
  EXPECT_EQ(m.grads(), expected);
  // From then on every bucket starts as soon as its gradients are final, the first ones while
  // most of the tape is still to run.
  for (auto& p : m.params) p.zero_grad();
  comm.tape_left_at_start.clear();
  m.backward(&comm, &reducer);
  ASSERT_EQ(comm.tape_left_at_start.size(), reducer.buckets().size());
  EXPECT_GT(comm.tape_left_at_start.front(), 10u);
  EXPECT_TRUE(std::is_sorted(comm.tape_left_at_start.rbegin(), comm.tape_left_at_start.rend()));
  reducer.finish();
  EXPECT_EQ(m.grads(), expected);
}

TEST(ZeroAdamW, UpdatesBlocksAsAdamWUpdatesTheWholeParameters) {
  optim::AdamWOptions ao;
  ao.lr = 1e-2;
  ao.max_grad_norm = 0;
  TinyModel plain;
  std::vector<bool> decay;
  for (const auto& p : plain.params) decay.push_back(p.value().dim() >= 2);
  optim::AdamW adamw(plain.params, ao, decay);
  TinyModel sharded;
  RecordingComm comm;
  dist::GradReducer reducer(comm, sharded.params, 4096, dist::ReduceMode::reduce_scatter);
  dist::ZeroAdamW zero(reducer, ao, decay);
  for (int step = 0; step < 3; ++step) {
    plain.backward(nullptr, nullptr);
    const double norm = adamw.step(ao.lr);
    adamw.zero_grad();
    sharded.backward(&comm, &reducer);
    reducer.finish();
    EXPECT_NEAR(zero.step(ao.lr), norm, 1e-6 * norm);
    for (auto& p : sharded.params) p.zero_grad();
  }
  for (size_t i = 0; i < plain.params.size(); ++i)
    EXPECT_EQ(plain.params[i].value().to_doubles(), sharded.params[i].value().to_doubles()) << i;
  std::vector<Tensor> m1, m2;
  zero.gather_state(m1, m2, true);
  for (size_t i = 0; i < plain.params.size(); ++i) {
    EXPECT_EQ(m1[i].to_doubles(), adamw.slots()[i].exp_avg.to_doubles()) << i;
    EXPECT_EQ(m2[i].to_doubles(), adamw.slots()[i].exp_avg_sq.to_doubles()) << i;
  }
}

TEST(ZeroAdamW, ARankWritesItsBlocksAndGathersOnlyWhatItIsAskedFor) {
  // Rank 1 of 2: its blocks are the second half of every bucket, so some start inside a
  // parameter. Each element written through the block views is its parameter's index and its
  // own; the gather must put it there, and rank 0's elements (-1 here) everywhere else.
  TinyModel m;
  SecondOfTwoComm comm;
  dist::GradReducer reducer(comm, m.params, 4096, dist::ReduceMode::reduce_scatter);
  const size_t buckets = reducer.buckets().size();
  ASSERT_GE(buckets, 4u);
  dist::ZeroAdamW zero(reducer, optim::AdamWOptions{}, std::vector<bool>(m.params.size(), true));
  const auto code = [](size_t param, int64_t element) {
    return static_cast<double>(param) * 1e4 + static_cast<double>(element);
  };
  bool mid_parameter = false;
  for (auto& block : zero.blocks()) {
    mid_parameter |= block.in_param > 0;
    for (int64_t j = 0; j < block.exp_avg.numel(); ++j) {
      block.exp_avg.data<float>()[j] = static_cast<float>(code(block.param, block.in_param + j));
      block.exp_avg_sq.data<float>()[j] =
          static_cast<float>(code(block.param, block.in_param + j)) + 0.5f;
    }
  }
  EXPECT_TRUE(mid_parameter);
  std::vector<Tensor> m1, m2;
  zero.gather_state(m1, m2, true);
  EXPECT_EQ(comm.all_gathers, static_cast<int>(2 * buckets));
  int64_t mine = 0, theirs = 0;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const auto first = m1[i].to_doubles(), second = m2[i].to_doubles();
    ASSERT_EQ(static_cast<int64_t>(first.size()), m.params[i].value().numel()) << i;
    for (size_t e = 0; e < first.size(); ++e) {
      if (first[e] == -1.0) {
        ASSERT_EQ(second[e], -1.0) << i << "[" << e << "]";
        ++theirs;
      } else {
        ASSERT_EQ(first[e], code(i, static_cast<int64_t>(e))) << i << "[" << e << "]";
        ASSERT_EQ(second[e], code(i, static_cast<int64_t>(e)) + 0.5) << i << "[" << e << "]";
        ++mine;
      }
    }
  }
  EXPECT_GT(mine, 0);
  EXPECT_GT(theirs, 0);
  // A rank that does not keep them takes part in every gather and holds nothing after.
  comm.all_gathers = 0;
  std::vector<Tensor> n1, n2;
  zero.gather_state(n1, n2, false);
  EXPECT_EQ(comm.all_gathers, static_cast<int>(2 * buckets));
  for (size_t i = 0; i < m.params.size(); ++i)
    EXPECT_FALSE(n1[i].defined() || n2[i].defined()) << i;
  // The first moments of the wanted parameters: only the buckets that hold them are gathered.
  std::vector<bool> wanted(m.params.size(), false);
  wanted.front() = wanted.back() = true;
  std::set<size_t> holding;
  for (size_t b = 0; b < buckets; ++b)
    for (const auto& e : reducer.buckets()[b].entries)
      if (wanted[e.param]) holding.insert(b);
  ASSERT_LT(holding.size(), buckets);
  comm.all_gathers = 0;
  const std::vector<Tensor> first = zero.gather_first_moments(wanted, true);
  EXPECT_EQ(comm.all_gathers, static_cast<int>(holding.size()));
  for (size_t i = 0; i < m.params.size(); ++i) {
    ASSERT_EQ(first[i].defined(), wanted[i]) << i;
    if (wanted[i]) EXPECT_EQ(first[i].to_doubles(), m1[i].to_doubles()) << i;
  }
}

TEST(ZeroAdamW, Bf16ComputeOnTheCpuIsRefusedAndF32WeightsRoundTrip) {
  optim::AdamWOptions ao;
  TinyModel m;
  RecordingComm comm;
  dist::GradReducer reducer(comm, m.params, 4096, dist::ReduceMode::reduce_scatter);
  std::vector<bool> decay(m.params.size(), true);
  dist::ZeroAdamW zero(reducer, ao, decay);
  std::string e;
  try {
    zero.compute_in_bf16();
  } catch (const Error& x) {
    e = x.what();
  }
  EXPECT_NE(e.find("bf16 compute needs the parameters on the GPU, they are on cpu"),
            std::string::npos)
      << e;
  EXPECT_FALSE(zero.computes_in_bf16());
  for (const auto& p : m.params) EXPECT_EQ(p.dtype(), DType::f32);
  // In f32 the weights a checkpoint takes are the parameters, and loading sets them.
  std::vector<Tensor> doubled;
  for (const Tensor& w : zero.gather_weights(true)) {
    Tensor d = w.clone();
    ops::scale_into(2.0, d, d);
    doubled.push_back(d);
  }
  zero.load_weights(doubled);
  for (size_t i = 0; i < m.params.size(); ++i)
    EXPECT_EQ(m.params[i].value().to_doubles(), doubled[i].to_doubles()) << i;
  // The next step starts from the loaded weights (other than those the optimizer saw when it was
  // made), as AdamW from the same weights does.
  std::vector<Tensor> halved;
  for (const Tensor& d : doubled) {
    Tensor h = d.clone();
    ops::scale_into(0.25, h, h);
    halved.push_back(h);
  }
  ao.max_grad_norm = 0;
  TinyModel plain;
  for (size_t i = 0; i < plain.params.size(); ++i) plain.params[i].value().copy_(halved[i]);
  optim::AdamW adamw(plain.params, ao, decay);
  plain.backward(nullptr, nullptr);
  adamw.step(ao.lr);
  dist::ZeroAdamW fresh(reducer, ao, decay);
  fresh.load_weights(halved);
  m.backward(&comm, &reducer);
  reducer.finish();
  fresh.step(ao.lr);
  for (size_t i = 0; i < m.params.size(); ++i)
    EXPECT_EQ(m.params[i].value().to_doubles(), plain.params[i].value().to_doubles()) << i;
  // Weights of another dtype or shape are refused, naming the parameter.
  std::vector<Tensor> wrong = halved;
  wrong[0] = Tensor::zeros({3}, DType::f32);
  EXPECT_THROW(fresh.load_weights(wrong), Error);
}

TEST(Loader, RanksTakeDisjointPartsThatCoverTheGlobalBatch) {
  auto rows_of = [](int rank, int world) {
    data::LoaderOptions lo;
    lo.manifests = {dataset()};
    lo.batch = 6;
    lo.seq = 16;
    lo.seed = 3;
    lo.rank = rank;
    lo.world = world;
    data::Loader loader(lo);
    std::vector<std::vector<int32_t>> rows;
    for (int call = 0; call < 5; ++call) {
      const model::Batch b = loader.next();
      EXPECT_EQ(b.tokens.size(0), 6 / world);
      const int32_t* t = b.tokens.data<int32_t>();
      for (int64_t r = 0; r < b.tokens.size(0); ++r)
        rows.emplace_back(t + r * 16, t + (r + 1) * 16);
    }
    return rows;
  };
  const auto whole = rows_of(0, 1);
  for (int world : {2, 3}) {
    // Call by call, rank 0's rows then rank 1's ... are exactly the single loader's rows.
    std::vector<std::vector<std::vector<int32_t>>> per_rank;
    for (int r = 0; r < world; ++r) per_rank.push_back(rows_of(r, world));
    const size_t per_call = 6 / static_cast<size_t>(world);
    std::vector<std::vector<int32_t>> joined;
    for (size_t call = 0; call < 5; ++call)
      for (int r = 0; r < world; ++r)
        for (size_t k = 0; k < per_call; ++k)
          joined.push_back(per_rank[static_cast<size_t>(r)][call * per_call + k]);
    EXPECT_EQ(joined, whole) << world << " ranks";
    // Disjoint: the windows of the global batch are distinct, so no row repeats within a call.
    for (size_t call = 0; call < 5; ++call) {
      std::set<std::vector<int32_t>> seen(whole.begin() + call * 6, whole.begin() + call * 6 + 6);
      EXPECT_EQ(seen.size(), 6u);
    }
  }
}

TEST(Buckets, PackLastParameterFirstAndPadToTheWorldSize) {
  std::vector<ag::Var> params;
  for (int64_t n : {10, 7, 3, 20}) params.emplace_back(Tensor::zeros({n}, DType::f32), true);
  const auto buckets = dist::plan_buckets(params, 12 * sizeof(float), 3);
  ASSERT_EQ(buckets.size(), 3u);  // {20}, {3, 7}, {10}
  ASSERT_EQ(buckets[0].entries.size(), 1u);
  EXPECT_EQ(buckets[0].entries[0].param, 3u);
  EXPECT_EQ(buckets[0].padded, 21);
  ASSERT_EQ(buckets[1].entries.size(), 2u);
  EXPECT_EQ(buckets[1].entries[0].param, 2u);
  EXPECT_EQ(buckets[1].entries[1].param, 1u);
  EXPECT_EQ(buckets[1].entries[1].offset, 3);
  EXPECT_EQ(buckets[1].padded, 12);
  EXPECT_EQ(buckets[2].entries[0].param, 0u);
  EXPECT_EQ(buckets[2].padded, 12);
}

TEST(Topology, ReadsTheLauncherEnvironment) {
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  const auto t = dist::topology_from_environment();
  EXPECT_EQ(t.world, 4);
  EXPECT_EQ(t.rank, 2);
  EXPECT_EQ(t.local_world, 2);
  EXPECT_EQ(t.launcher, "mpirun");
  setenv("OMPI_COMM_WORLD_RANK", "two", 1);
  try {
    dist::topology_from_environment();
    ADD_FAILURE() << "a malformed rank was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_RANK"), std::string::npos) << e.what();
  }
  // A launcher's variable missing beside the others (an environment copied by hand) is named,
  // not taken as 0: a wrong local rank picks the wrong GPU and thread count.
  setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  try {
    dist::topology_from_environment();
    ADD_FAILURE() << "a missing local rank was taken as 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_LOCAL_RANK is not"), std::string::npos)
        << e.what();
  }
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    unsetenv(v);
  // srun -n 7 over 4 nodes, --mpi=pmix: 2, 2, 2 and 1 tasks; rank 5 is task 1 of node 2.
  setenv("SLURM_STEP_NUM_TASKS", "7", 1);
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NODEID", "2", 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),1", 1);
  setenv("PMIX_RANK", "5", 1);
  const auto s = dist::topology_from_environment();
  EXPECT_EQ(s.launcher, "slurm");
  EXPECT_EQ(s.world, 7);
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world, 2);
  // Rank 6 alone on the last node: its node's count, not the first node's.
  setenv("SLURM_PROCID", "6", 1);
  setenv("SLURM_LOCALID", "0", 1);
  setenv("SLURM_NODEID", "3", 1);
  EXPECT_EQ(dist::topology_from_environment().local_world, 1);
  auto expect_error = [](const std::string& needle) {
    try {
      dist::topology_from_environment();
      ADD_FAILURE() << "no error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3", 1);
  expect_error("SLURM_STEP_TASKS_PER_NODE='2(x3'");
  setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3)", 1);
  expect_error("lists fewer nodes than SLURM_NODEID=3");
  // srun without --mpi=pmix: MPI_Init could not join the ranks; say so before it fails (and
  // after a command that runs as one process was refused as such).
  setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),1", 1);
  unsetenv("PMIX_RANK");
  const auto expect_unjoinable = [] {
    const dist::Topology t = dist::topology_from_environment();
    try {
      dist::check_joinable(t);
      ADD_FAILURE() << "srun's ranks without PMIx taken as joinable";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("srun --mpi=pmix"), std::string::npos) << e.what();
    }
    try {
      dist::refuse_ranks_unless_supported({"fed", "post", "--config", "x"}, t);
      ADD_FAILURE() << "fed post started as ranks";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("runs as one process"), std::string::npos) << e.what();
    }
  };
  expect_unjoinable();
  setenv("PMI_SIZE", "7", 1);  // srun --mpi=pmi2
  setenv("PMI_RANK", "6", 1);
  expect_unjoinable();
  unsetenv("PMI_SIZE");
  unsetenv("PMI_RANK");
  for (const char* v : {"SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                        "SLURM_STEP_TASKS_PER_NODE"})
    unsetenv(v);
  EXPECT_FALSE(dist::topology_from_environment().distributed());
}

TEST(Launch, RunsMpirunWithoutBindingAndAllowsMoreRanksThanCores) {
  dist::LaunchOptions o;
  o.nproc = 3;
  const auto cmd = dist::launch_command(o, "/bin/pollen", {"train", "--config", "r.toml"});
  ASSERT_GE(cmd.size(), 9u);
  EXPECT_EQ(cmd[0], "mpirun");
  EXPECT_EQ(cmd[2], "3");
  EXPECT_NE(std::find(cmd.begin(), cmd.end(), "none"), cmd.end());
  EXPECT_NE(std::find(cmd.begin(), cmd.end(), "--oversubscribe"), cmd.end());
  EXPECT_EQ(cmd[cmd.size() - 4], "/bin/pollen");
  EXPECT_EQ(cmd.back(), "r.toml");
}

// Any command but train, sft, dpo, rm, grpo and fed client, started as several ranks, would run
// once per rank into the same run folder: it is refused before it reads its config, under a
// launcher's environment and by pollen launch before mpirun starts.
TEST(Launch, CommandsThatRunAsOneProcessAreRefusedAsSeveralRanks) {
  EXPECT_TRUE(dist::runs_as_ranks({"train", "--config", "r.toml"}));
  EXPECT_TRUE(dist::runs_as_ranks({"fed", "client", "--config", "c.toml"}));
  EXPECT_FALSE(dist::runs_as_ranks({"fed", "server", "--config", "f.toml"}));
  EXPECT_TRUE(dist::runs_as_ranks({"sft", "--config", "s.toml"}));
  EXPECT_TRUE(dist::runs_as_ranks({"dpo", "--config", "d.toml"}));
  EXPECT_TRUE(dist::runs_as_ranks({"rm", "--config", "r.toml"}));
  EXPECT_TRUE(dist::runs_as_ranks({"grpo", "--config", "g.toml"}));
  EXPECT_FALSE(dist::runs_as_ranks({"grpo", "synth", "--out", "g.jsonl"}));
  EXPECT_FALSE(dist::runs_as_ranks({"fed", "post", "--config", "p.toml"}));
  EXPECT_FALSE(dist::runs_as_ranks({"rm", "score", "--model", "m"}));
  EXPECT_FALSE(dist::runs_as_ranks({"sft", "synth", "--out", "s.jsonl"}));
  EXPECT_FALSE(dist::runs_as_ranks({"dpo", "synth"}));
  EXPECT_TRUE(dist::runs_as_ranks({"rm"}));
  const std::string mpirun_env =
      "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=2 "
      "OMPI_COMM_WORLD_LOCAL_RANK=0 ";
  int status = 0;
  const std::string post = pollen::testing::run_capture(
      mpirun_env + POLLEN_BINARY + " fed post --config /nonexistent/post.toml", &status);
  EXPECT_EQ(status, 1) << post;
  EXPECT_NE(post.find("pollen fed post runs as one process, but mpirun started 2 ranks"),
            std::string::npos)
      << post;
  const std::string score = pollen::testing::run_capture(
      mpirun_env + POLLEN_BINARY + " rm score --model m --data d.jsonl --out s.jsonl", &status);
  EXPECT_NE(score.find("pollen rm score runs as one process"), std::string::npos) << score;
  const std::string fed = pollen::testing::run_capture(
      mpirun_env + POLLEN_BINARY + " fed simulate --config /nonexistent/sim.toml", &status);
  EXPECT_NE(fed.find("pollen fed simulate runs as one process"), std::string::npos) << fed;
  const std::string options_only = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) + " launch --nproc 2 --mpirun /nonexistent/mpirun -- --help",
      &status);
  EXPECT_NE(options_only.find("pollen --help runs as one process"), std::string::npos)
      << options_only;
  const std::string unknown = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) + " launch --nproc 2 --mpirun /nonexistent/mpirun -- trian",
      &status);
  EXPECT_EQ(status, 2) << unknown;
  EXPECT_NE(unknown.find("'trian' is not a pollen command"), std::string::npos) << unknown;
  // A rank command given its run file without --config is told so, not that it runs as one
  // process; a path is no part of a command's name.
  const std::string positional = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) +
          " launch --nproc 2 --mpirun /nonexistent/mpirun -- train r2.toml",
      &status);
  EXPECT_EQ(status, 1) << positional;
  EXPECT_NE(positional.find("pollen train: 'r2.toml' is not one of its options (the run file goes "
                            "after --config: pollen train --config r2.toml)"),
            std::string::npos)
      << positional;
  const std::string bare = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) + " launch --nproc 2 --mpirun /nonexistent/mpirun -- sft myrun",
      &status);
  EXPECT_NE(bare.find("pollen sft: 'myrun' is not one of its options"), std::string::npos) << bare;
  const std::string plot = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) + " launch --nproc 2 --mpirun /nonexistent/mpirun -- plot runs/r1",
      &status);
  EXPECT_NE(plot.find("pollen plot runs as one process"), std::string::npos) << plot;
  const std::string launched = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) +
          " launch --nproc 3 --mpirun /nonexistent/mpirun -- data prepare "
          "--config /nonexistent/data.toml",
      &status);
  EXPECT_EQ(status, 1) << launched;
  EXPECT_NE(
      launched.find("pollen data prepare runs as one process, but pollen launch started 3 ranks"),
      std::string::npos)
      << launched;
}

TEST(DataParallel, TwoAndThreeRanksTrainAsOneProcessAndRepeatBitwise) {
  const auto& ref = reference_losses();
  ASSERT_EQ(ref.size(), 8u);
  std::vector<double> first_two;
  for (int ranks : {2, 3, 2}) {
    const fs::path d = temp_dir("dp" + std::to_string(ranks) + (first_two.empty() ? "" : "again"));
    const Outcome o = train(ranks, write_run(d, 8));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    const auto losses = train_losses(d / "run");
    expect_close(losses, ref, 2e-5, std::to_string(ranks) + " ranks");
    // Rank 0 names every rank's place: here all on one node, local rank = rank.
    const std::string last = std::to_string(ranks - 1);
    EXPECT_NE(o.output.find("ranks: 0 on "), std::string::npos) << o.output;
    EXPECT_NE(o.output.find(", " + last + " on "), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("(local " + last + " of " + std::to_string(ranks) + ")"),
              std::string::npos)
        << o.output;
    const auto recs = records(d / "run", "loss");
    EXPECT_EQ(recs.back()["ranks"], ranks);
    EXPECT_GE(recs.back()["reduce_wait_frac"].get<double>(), 0.0);
    EXPECT_EQ(summary(d / "run")["ranks"], ranks);
    // One validation loss for the job, the same as one process's to rounding.
    EXPECT_EQ(records(d / "run", "val_loss").size(), 1u);
    if (ranks == 2 && first_two.empty()) {
      first_two = losses;
    } else if (ranks == 2) {
      EXPECT_EQ(losses, first_two) << "a fixed world size must repeat bitwise";
    }
  }
}

// DP-SGD over ranks: every rank draws rank 0's sample and takes every world-th sequence of it,
// rank 0 adds the noise: with a seeded sample and noise, 2 and 3 ranks train as one process does
// and account the same epsilon, with the optimizer's state replicated or sharded (ZeRO-1).
TEST(DataParallel, PrivateTrainingOverRanksReleasesWhatOneProcessDoes) {
  const std::string privacy = "\n[privacy]\nclip = 1.0\nnoise_multiplier = 0.3\nnoise_seed = 11\n";
  std::vector<double> one;
  std::vector<int64_t> one_sampled;
  double epsilon = 0;
  for (int ranks : {1, 2, 3}) {
    const fs::path d = temp_dir("private" + std::to_string(ranks));
    const Outcome o = train(ranks, write_run(d, 6, privacy));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    const auto losses = train_losses(d / "run");
    std::vector<int64_t> sampled;
    for (const auto& r : records(d / "run", "loss")) sampled.push_back(r["sampled"].get<int64_t>());
    const double spent = summary(d / "run")["privacy"]["epsilon"].get<double>();
    if (ranks == 1) {
      one = losses;
      one_sampled = sampled;
      epsilon = spent;
      ASSERT_EQ(one.size(), 6u);
    } else {
      expect_close(losses, one, 2e-5, std::to_string(ranks) + " private ranks");
      EXPECT_EQ(sampled, one_sampled) << "every rank draws rank 0's sample";
      EXPECT_EQ(spent, epsilon);
      double waited = 0;  // the clipped sums' reduction is timed
      for (const auto& r : records(d / "run", "loss")) waited += r["reduce_wait_s"].get<double>();
      EXPECT_GT(waited, 0.0);
    }
  }
  // ZeRO-1: the ranks' shares reduce-scattered into each rank's blocks, as a plain step's
  // gradients are (small buckets: parameters cut across the ranks' blocks).
  for (int ranks : {2, 3}) {
    const fs::path d = temp_dir("private_zero" + std::to_string(ranks));
    const Outcome o = train(ranks, write_run(d, 6, "zero = 1\nbucket_mb = 0.01\n" + privacy));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    expect_close(train_losses(d / "run"), one, 2e-5, cat("ZeRO-1, ", ranks, " private ranks"));
    EXPECT_EQ(summary(d / "run")["privacy"]["epsilon"].get<double>(), epsilon);
    EXPECT_EQ(summary(d / "run")["zero"], 1);
  }
}

TEST(DataParallel, ZeroShardsTheOptimizerStateAndTrainsAsPlainDataParallel) {
  const auto& ref = reference_losses();
  std::vector<double> replicated_bytes;
  for (int zero : {0, 1}) {
    for (int ranks : {2, 3}) {
      const fs::path d = temp_dir("zero" + std::to_string(zero) + "_" + std::to_string(ranks));
      // Small buckets: several per step, and parameters cut across ranks' blocks.
      const Outcome o =
          train(ranks, write_run(d, 8, "zero = " + std::to_string(zero) + "\nbucket_mb = 0.01\n"));
      ASSERT_EQ(o.exit_code, 0) << o.output;
      expect_close(train_losses(d / "run"), ref, 2e-5, cat("zero ", zero, ", ", ranks, " ranks"));
      const auto bytes =
          summary(d / "run")["optimizer_state_bytes_per_rank"].get<std::vector<double>>();
      ASSERT_EQ(bytes.size(), static_cast<size_t>(ranks));
      if (zero == 0) {
        for (double b : bytes) EXPECT_EQ(b, bytes[0]);
        replicated_bytes.push_back(bytes[0]);
        continue;
      }
      const double whole = replicated_bytes.at(0);
      for (double b : bytes) {
        EXPECT_LE(b, whole / ranks * 1.01 + 1024) << ranks << " ranks";  // padding only
        EXPECT_GE(b, whole / ranks * 0.99) << ranks << " ranks";
      }
    }
  }
}

TEST(DataParallel, KilledRankEndsTheJobAndResumesAtAnotherWorldSize) {
  const auto& ref = reference_losses();
  const fs::path d = temp_dir("killed");
  const fs::path config = write_run(d, 8);
  const Outcome killed =
      train(2, config, "--set checkpoint.interval=2", "POLLEN_FAULT_INJECT=kill:1:6");
  EXPECT_NE(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("rank 1"), std::string::npos) << killed.output;
  // Not finished: "running" as it began, or "failed" when rank 0 saw the dead rank before mpirun
  // ended it.
  const std::string status = nlohmann::json::parse(read_file(d / "run" / "summary.json"))["status"];
  EXPECT_TRUE(status == "running" || status == "failed") << status;
  EXPECT_EQ(io::checkpoint_step(io::list_checkpoints(d / "run" / "checkpoints").back()), 4);
  // Resume the 2-rank run as 3 ranks with ZeRO-1: the run continues to the same losses.
  const Outcome resumed =
      train(3, config, "--resume --set checkpoint.interval=2 --set parallel.zero=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  expect_close(train_losses(d / "run"), ref, 2e-5, "resumed at 3 ranks");
}

// A run without train.batch_tokens (micro_batch * seq by default) that cannot split its rows among
// more ranks says what to set, and the run resumes on them as it says.
TEST(DataParallel, ARunWithTheDefaultBatchResumesOnMoreRanksAsTheErrorSays) {
  const fs::path d = temp_dir("default_batch");
  std::string toml =
      test_support::tiny_run_toml(d / "run", dataset(), 4, "\n[parallel]\ntimeout_s = 60\n");
  const std::string given = "batch_tokens = 128\n";
  ASSERT_NE(toml.find(given), std::string::npos);
  toml.erase(toml.find(given), given.size());  // 4 rows of 16 tokens per step
  toml.replace(toml.find("threads = 2"), 11, "threads = 1");
  write_file_atomic(d / "run.toml", toml);
  const Outcome first = train(1, d / "run.toml", "--set train.steps=2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const Outcome refused = train(2, d / "run.toml", "--resume");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("train.micro_batch may be 1, 2 (--set train.micro_batch=N --set "
                                "train.batch_tokens=64"),
            std::string::npos)
      << refused.output;
  const Outcome resumed =
      train(2, d / "run.toml", "--resume --set train.micro_batch=2 --set train.batch_tokens=64");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(train_losses(d / "run").size(), 4u);
}

// What differs is named by where it is: the run file's line, the option, or the data file with
// this rank's copy of it.
TEST(SameInputs, TheRunFileOptionOrDataFileThatDiffersIsNamed) {
  const fs::path d = temp_dir("same_inputs");
  write_file_atomic(d / "run.toml", "a = 1\n");
  write_file_atomic(d / "train.json", "train");
  write_file_atomic(d / "valid.json", "valid");
  const dist::RankInputs root{d / "run.toml", {"--set x=1"}, {d / "train.json", d / "valid.json"}};
  const std::string root_text = dist::rank_inputs_text(root);
  EXPECT_EQ(dist::inputs_difference(root, root_text, root_text, 1), "");
  dist::RankInputs resumed = root;
  resumed.options.push_back("--resume");
  EXPECT_EQ(dist::inputs_difference(resumed, root_text, dist::rank_inputs_text(resumed), 1),
            "the command's options: rank 0 has nothing, rank 1 has '--resume'");
  write_file_atomic(d / "stale.json", "stale");
  dist::RankInputs stale = root;
  stale.data_files[1] = d / "stale.json";
  const std::string e = dist::inputs_difference(stale, root_text, dist::rank_inputs_text(stale), 1);
  EXPECT_NE(e.find("the data: rank 0 has 'data file 2 of 2, SHA-256 "), std::string::npos) << e;
  EXPECT_NE(e.find("(this rank's copy: '" + (d / "stale.json").string() + "')"), std::string::npos)
      << e;
  write_file_atomic(d / "other.toml", "a = 2\n");
  dist::RankInputs other = root;
  other.run_file = d / "other.toml";
  EXPECT_EQ(dist::inputs_difference(other, root_text, dist::rank_inputs_text(other), 1),
            (d / "other.toml").string() + ", line 1: rank 0 has 'a = 1', rank 1 has 'a = 2'");
  fs::remove_all(d);
}

// A rank that runs another run file than rank 0 (a stale copy on its node) ends the job before
// its first step, naming the line that differs, instead of training another model unseen.
TEST(DataParallel, ARankWithAnotherRunFileEndsTheJobNamingTheLine) {
  const fs::path d = temp_dir("other_run_file");
  const fs::path config = write_run(d, 4);
  std::string text = read_file(config);
  ASSERT_NE(text.find("seed = 7"), std::string::npos);
  text.replace(text.find("seed = 7"), 8, "seed = 8");
  write_file_atomic(d / "stale.toml", text);
  std::string cmd = "mpirun --oversubscribe --bind-to none ";
  if (geteuid() == 0) cmd += "--allow-run-as-root ";
  cmd += cat("-np 1 ", POLLEN_BINARY, " train --config ", config.string(), " : -np 1 ",
             POLLEN_BINARY, " train --config ", (d / "stale.toml").string(), " 2>&1");
  int status = 0;
  const std::string out = pollen::testing::run_capture(cmd, &status);
  EXPECT_NE(status, 0) << out;
  EXPECT_NE(out.find("rank 1 runs another run file, options or data than rank 0"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("rank 0 has 'seed = 7', rank 1 has 'seed = 8'"), std::string::npos) << out;
  EXPECT_TRUE(io::list_checkpoints(d / "run" / "checkpoints").empty());
}

TEST(DataParallel, HungRankIsNamedWithExitCodeFourAndResumeFinishesTheRun) {
  const auto& ref = reference_losses();
  const fs::path d = temp_dir("hung");
  const fs::path config = write_run(d, 8);
  const Outcome hung = train(2, config, "--set checkpoint.interval=2 --set parallel.timeout_s=5",
                             "POLLEN_FAULT_INJECT=hang:1:4");
  EXPECT_EQ(hung.exit_code, 4) << hung.output;
  EXPECT_NE(hung.output.find("rank 1 never reached it (dead or hung)"), std::string::npos)
      << hung.output;
  EXPECT_NE(hung.output.find("--resume"), std::string::npos) << hung.output;
  const Outcome resumed = train(2, config, "--resume --set checkpoint.interval=2");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from"), std::string::npos) << resumed.output;
  expect_close(train_losses(d / "run"), ref, 2e-5, "resumed after a hang");
}

// A warning about what the ranks share comes from rank 0 alone; a rank's own comes from that rank.
TEST(DataParallel, RankZeroAloneWarnsOfWhatTheRanksShare) {
  const fs::path d = temp_dir("shared_warning");
  const Outcome o =
      train(2, write_run(d, 2), "--set schedule.warmup_steps=10", "POLLEN_FAULT_INJECT=error:1:2");
  const std::string warning = "schedule.warmup_steps (10) is more than train.steps (2)";
  const size_t first = o.output.find(warning);
  ASSERT_NE(first, std::string::npos) << o.output;
  EXPECT_EQ(o.output.find(warning, first + 1), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("rank 1: POLLEN_FAULT_INJECT: an error before step 2"), std::string::npos)
      << o.output;
}

// OpenMPI's MPI_Init waits for every rank: one that stalls before it would hold the others there
// with no collective's watchdog running yet.
TEST(DataParallel, RankHungBeforeMpiStartsEndsTheJobWithExitCodeFour) {
  const fs::path d = temp_dir("hung_start");
  const Outcome hung =
      train(2, write_run(d, 4), "--set parallel.timeout_s=5", "POLLEN_FAULT_INJECT=hang:1:0");
  EXPECT_EQ(hung.exit_code, 4) << hung.output;
  EXPECT_NE(hung.output.find("rank 1: POLLEN_FAULT_INJECT: hanging before MPI starts"),
            std::string::npos)
      << hung.output;
  EXPECT_NE(hung.output.find("rank 0: MPI did not start within 5 s (parallel.timeout_s): a rank "
                             "of the 2 did not reach MPI_Init (hung or never started)"),
            std::string::npos)
      << hung.output;
  EXPECT_TRUE(io::list_checkpoints(d / "run" / "checkpoints").empty());
}

// A rank that hangs in the middle of backward has started the buckets before that point, but MPI
// moves them only inside every rank's calls: the others, which started the rest, name it.
TEST(DataParallel, RankHungInBackwardIsNamedThoughItStartedTheBucketWaitedFor) {
  const fs::path d = temp_dir("hung_backward");
  // Buckets of about 10 KiB, above shared memory's eager limit (4 KiB): none completes on its
  // sender alone.
  const Outcome hung = train(2, write_run(d, 4, "bucket_mb = 0.01\n"), "--set parallel.timeout_s=5",
                             "POLLEN_FAULT_INJECT=hang_backward:1:3");
  EXPECT_EQ(hung.exit_code, 4) << hung.output;
  EXPECT_NE(hung.output.find("rank 1: POLLEN_FAULT_INJECT: hanging in step 3 after the gradient "
                             "reduction of bucket 0 started"),
            std::string::npos)
      << hung.output;
  EXPECT_NE(hung.output.find("rank 0: the gradient reduction of bucket 0 did not complete within "
                             "5 s (parallel.timeout_s): rank 1 reached it but not the collectives "
                             "this rank started after it (dead or hung since"),
            std::string::npos)
      << hung.output;
  // Before the first checkpoint a rerun starts again, and the message says so.
  EXPECT_NE(hung.output.find("It wrote no checkpoint yet"), std::string::npos) << hung.output;
  EXPECT_EQ(hung.output.find("to continue from the last checkpoint"), std::string::npos)
      << hung.output;
  // One "rank 1: " for a message that names its rank already.
  EXPECT_EQ(hung.output.find("rank 1: rank 1"), std::string::npos) << hung.output;
}

TEST(DataParallel, SingleProcessNeedsNoLauncher) {
  const auto c = dist::connect(5);
  EXPECT_EQ(c->world(), 1);
  EXPECT_EQ(c->rank(), 0);
  float in[3] = {1, 2, 3}, out[3] = {};
  c->wait(c->start_all_gather(in, out, 3, "copy"));
  EXPECT_EQ(out[2], 3.0f);
}

TEST(DataParallel, NcclWithoutAGpuIsRefusedSayingWhy) {
  if (!cuda_devices().empty()) GTEST_SKIP() << "a GPU is usable here (tests/cuda covers NCCL)";
  dist::SingleProcess host;
  std::string e;
  try {
    dist::NcclCommunicator comm(host, 5);
  } catch (const Error& x) {
    e = x.what();
  }
  // A CUDA build names the missing GPU and the runtime's reason, a CPU build the missing NCCL.
  const bool names_gpus = e.find("0 usable GPU(s): run one rank per GPU") != std::string::npos;
  const bool names_nccl = e.find("needs NCCL") != std::string::npos;
  EXPECT_TRUE(names_gpus || names_nccl) << e;
}

// NCCL is loaded at run time: where this pollen was built with it, the library loads, every
// function binds and a unique id is made (that needs no GPU).
TEST(DataParallel, NcclLoadsAtRunTimeAndMakesAUniqueId) {
  if (!dist::nccl::built()) GTEST_SKIP() << "built without NCCL";
  const dist::nccl::UniqueId id = dist::nccl::make_unique_id();
  EXPECT_TRUE(std::any_of(id.begin(), id.end(), [](char c) { return c != 0; }));
}

TEST(Buckets, Bf16ParametersOnTheCpuAreRefusedNamingThem) {
  std::vector<ag::Var> params;
  params.emplace_back(Tensor::zeros({4}, DType::bf16), true, "layer.weight");
  std::string e;
  try {
    dist::plan_buckets(params, 1024, 2);
  } catch (const Error& x) {
    e = x.what();
  }
  EXPECT_NE(e.find("parameter 'layer.weight' is bf16 on cpu"), std::string::npos) << e;
}
