// GRPO through the post-training loop: a run whose [grpo] section has a nested [grpo.verifier]
// table resumes from its checkpoint (the resolved config keeps the nested table).
#include <gtest/gtest.h>

#include <fstream>

#include "train/grpo.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/post_run.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

struct GrpoRunFiles {
  fs::path dir, tokenizer_path, model_file, prompts;
};

GrpoRunFiles grpo_run_files(const std::string& name) {
  GrpoRunFiles f;
  f.dir = test_support::post_temp_dir(name);
  f.tokenizer_path = test_support::make_chat_tokenizer(f.dir);
  f.model_file = test_support::make_tiny_model_file(f.dir);
  f.prompts = f.dir / "prompts.jsonl";
  std::ofstream out(f.prompts);
  for (const auto& e : train::synth_examples("arithmetic", 16, 5))
    out << train::grpo_jsonl_line(e) << "\n";
  return f;
}

train::PostResult run_grpo(const std::string& text, bool resume, int64_t stop_after = -1) {
  train::PostOptions o;
  o.quiet = true;
  o.handle_signals = false;
  o.resume = resume;
  o.stop_after = stop_after;
  const train::PostConfig c = train::parse_post_config(text, "grpo.toml", "grpo");
  return train::run_post_training(c, o, [&](const train::ObjectiveContext& context) {
    return train::make_grpo_objective(context, c.base);
  });
}

TEST(GrpoRun, ResumesARunWhoseSectionHasANestedVerifierTable) {
  const GrpoRunFiles f = grpo_run_files("grpo_resume");
  const std::string section = "[grpo]\ndata = \"" + f.prompts.string() +
                              "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\n"
                              "max_completion_tokens = 6\n\n[grpo.verifier]\nkind = \"numeric\"\n"
                              "abs_tol = 0.5\n";
  const fs::path run_dir = f.dir / "run";
  const std::string text =
      test_support::tiny_post_toml(run_dir, f.model_file, f.tokenizer_path, 4, section);
  const train::PostResult first = run_grpo(text, false, 2);
  ASSERT_FALSE(first.last_checkpoint.empty());
  // The checkpoint's resolved config holds the nested table as dotted keys and reads back.
  const train::PostConfig saved =
      train::load_post_config(first.last_checkpoint / "config.toml", "grpo");
  ConfigTable saved_section = saved.objective_section();
  auto verifier = saved_section.table("verifier");
  ASSERT_TRUE(verifier.has_value());
  EXPECT_EQ(verifier->get_string("kind", ""), "numeric");
  EXPECT_EQ(verifier->get_double("abs_tol", 0), 0.5);

  const train::PostResult resumed = run_grpo(text, true);
  EXPECT_EQ(resumed.status, train::RunStatus::finished) << resumed.message;
  // A changed verifier is a changed objective: the resumed run refuses it, naming the key.
  const std::string changed = test_support::tiny_post_toml(
      f.dir / "run2", f.model_file, f.tokenizer_path, 4,
      "[grpo]\ndata = \"" + f.prompts.string() +
          "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\nmax_completion_tokens = 6\n"
          "\n[grpo.verifier]\nkind = \"numeric\"\nabs_tol = 0.25\n");
  fs::copy(run_dir, f.dir / "run2", fs::copy_options::recursive);
  std::string error;
  try {
    run_grpo(changed, true);
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("grpo.verifier.abs_tol"), std::string::npos) << error;
  fs::remove_all(f.dir);
}

}  // namespace
