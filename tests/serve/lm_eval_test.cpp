// The peer: lm-evaluation-harness (PyPI lm-eval, build/peers-lmeval) runs a local multiple-choice
// task against `pollen serve` through its local-completions backend and must report the same acc
// and acc_norm as `pollen eval --task`, with the same log-likelihood for every choice.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "base/files.h"
#include "support/tiny_lm.h"

namespace pollen {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// A child process whose stdout we read line by line; killed when it goes out of scope.
class Child {
 public:
  explicit Child(const std::vector<std::string>& argv) {
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    if (out_) fclose(out_);
  }
  std::string line() {
    char buf[4096];
    return fgets(buf, sizeof buf, out_) ? std::string(buf) : std::string();
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
};

int run(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

const char* kTask = R"(task: pollen_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: TASK_FILE
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
)";

TEST(LmEvalPeer, LocalCompletionsAgainstPollenServeMatchesPollenEval) {
  const fs::path python = POLLEN_LMEVAL_PEERS_PYTHON;
  ASSERT_TRUE(fs::exists(python)) << python << " is missing: run scripts/test-peers";
  const fs::path dir = testing::unique_temp_dir("lm_eval_peer");
  const auto tok = testing::tiny_tokenizer();
  testing::write_hf_dir(testing::tiny_model(tok.vocab_size()), tok, dir / "model");

  // Choices of very different lengths (acc_norm differs from acc), a context ending in a space
  // (lm-eval moves it to the continuation) and a non-ASCII choice (length in characters).
  const std::vector<json> items = {
      {{"context", "The cat sat on the"},
       {"choices", {"mat.", "log in the sun", "bees"}},
       {"gold", 0}},
      {{"context", "Paris is the capital of"},
       {"choices", {"France.", "Italy.", "honey"}},
       {"gold", 0}},
      {{"context", "Rome is the capital of "},
       {"choices", {"Italy.", "France and Paris"}},
       {"gold", 0}},
      {{"context", "Water boils at one hundred"},
       {"choices", {"degrees.", "cats", "flowers need bees"}},
       {"gold", 0}},
      {{"context", "Bees make honey from"},
       {"choices", {"flowers", "ice", "the caf\xc3\xa9"}},
       {"gold", 0}},
      {{"context", "Question: what is two plus two? Answer:"},
       {"choices", {"four.", "two", "one hundred"}},
       {"gold", 0}},
      {{"context", "Ice melts in the"}, {"choices", {"sun.", "dog sat on the log"}}, {"gold", 0}},
      {{"context", "The dog sat on the"},
       {"choices", {"log.", "mat", "capital of France"}},
       {"gold", 0}},
      {{"context", "Flowers need"}, {"choices", {"bees.", "degrees", "a"}}, {"gold", 2}},
      {{"context", "The capital of France is"},
       {"choices", {"Paris.", "Rome", "water"}},
       {"gold", 1}}};
  std::string jsonl;
  for (const auto& it : items) jsonl += it.dump() + "\n";
  const fs::path task = dir / "task.jsonl";
  write_file_atomic(task, jsonl);
  std::string yaml = kTask;
  yaml.replace(yaml.find("TASK_FILE"), 9, task.string());
  fs::create_directories(dir / "tasks");
  write_file_atomic(dir / "tasks" / "pollen_mc.yaml", yaml);

  // pollen eval
  const std::string pollen = POLLEN_BINARY;
  ASSERT_EQ(run(pollen + " eval --model " + (dir / "model").string() + " --task " + task.string() +
                " --details " + (dir / "details.jsonl").string() + " --output " +
                (dir / "pollen.json").string() + " --threads 1 > /dev/null"),
            0);
  const json ours = json::parse(read_file(dir / "pollen.json"));
  std::vector<json> details;
  {
    std::ifstream in(dir / "details.jsonl");
    std::string line;
    while (std::getline(in, line)) details.push_back(json::parse(line));
  }
  ASSERT_EQ(details.size(), items.size());
  bool norm_differs = false;
  for (const auto& d : details) norm_differs |= d["pred"] != d["pred_norm"];
  EXPECT_TRUE(norm_differs) << "the task should have an item where acc and acc_norm disagree";

  // pollen serve on a free port, lm-eval against it.
  Child server({pollen, "serve", "--model", (dir / "model").string(), "--port", "0", "--name",
                "tiny", "--threads", "1"});
  const std::string banner = server.line();
  const size_t colon = banner.rfind(':');
  ASSERT_NE(colon, std::string::npos) << banner;
  const int port = std::stoi(banner.substr(colon + 1));
  const fs::path out = dir / "lm_eval_out";
  const std::string cmd =
      "cd " + dir.string() +
      " && HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false " + python.string() +
      " -m lm_eval run --model local-completions --model_args base_url=http://127.0.0.1:" +
      std::to_string(port) +
      "/v1/completions,model=tiny,tokenizer_backend=remote,tokenized_requests=True,max_retries=1 "
      "--tasks pollen_mc --include_path " +
      (dir / "tasks").string() + " --output_path " + out.string() +
      " --log_samples --batch_size 1 > " + (dir / "lm_eval.log").string() + " 2>&1";
  ASSERT_EQ(run(cmd), 0) << read_file(dir / "lm_eval.log");

  json results, samples = json::array();
  for (const auto& e : fs::recursive_directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("results_")) results = json::parse(read_file(e.path()));
    if (name.starts_with("samples_pollen_mc")) {
      std::ifstream in(e.path());
      std::string line;
      while (std::getline(in, line)) samples.push_back(json::parse(line));
    }
  }
  ASSERT_TRUE(results.is_object()) << "no results file under " << out;
  const json& r = results["results"]["pollen_mc"];
  std::printf("pollen eval: acc %.6f acc_norm %.6f | lm-eval: acc %.6f acc_norm %.6f\n",
              ours["acc"].get<double>(), ours["acc_norm"].get<double>(),
              r["acc,none"].get<double>(), r["acc_norm,none"].get<double>());
  EXPECT_DOUBLE_EQ(r["acc,none"].get<double>(), ours["acc"].get<double>());
  EXPECT_DOUBLE_EQ(r["acc_norm,none"].get<double>(), ours["acc_norm"].get<double>());
  EXPECT_NEAR(r["acc_stderr,none"].get<double>(), ours["acc_stderr"].get<double>(), 1e-12);
  EXPECT_NEAR(r["acc_norm_stderr,none"].get<double>(), ours["acc_norm_stderr"].get<double>(),
              1e-12);
  // Every choice's log-likelihood, item by item.
  ASSERT_EQ(samples.size(), items.size());
  for (const json& s : samples) {
    const size_t i = s["doc_id"].get<size_t>();
    const json& lls = details.at(i)["logprobs"];
    ASSERT_EQ(s["resps"].size(), lls.size()) << i;
    for (size_t c = 0; c < lls.size(); ++c) {
      const json& ll = s["resps"][c][0][0];  // lm-eval logs it as a string
      const double theirs = ll.is_string() ? std::stod(ll.get<std::string>()) : ll.get<double>();
      EXPECT_NEAR(theirs, lls[c].get<double>(), 1e-4) << "item " << i << " choice " << c;
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pollen
