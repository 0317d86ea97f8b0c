// `pollen dpo --config run.toml [--set key=value ...] [--resume]`, `pollen rm --config ...` (which
// also exports the trained reward model to run.dir/reward_model), `pollen dpo synth` and `pollen
// rm synth` (preference pairs made by a rule), `pollen rm score --model RM --data JSONL --out
// FILE` (a reward model's scores of prompt/response records): wiring only; the work is
// train::run_post_training with train/dpo and train/reward, and train/preference_synth.
#include <cstdio>
#include <memory>
#include <string>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"
#include "cli/commands.h"
#include "cli/model_args.h"
#include "cli/post_command.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/open.h"
#include "train/dpo.h"
#include "train/post_config.h"
#include "train/post_run.h"
#include "train/preference_synth.h"
#include "train/reward.h"

namespace pollen::cli {
namespace {

void add_synth(CLI::App* cmd, bool responses_option) {
  auto* synth =
      cmd->add_subcommand("synth",
                          "Write preference pairs made by a rule (the chosen reply follows it, the "
                          "rejected one does not) as prompt/chosen/rejected JSONL");
  struct Args {
    train::PreferenceSynthOptions o;
    bool text = false;
    std::string out;
  };
  auto a = std::make_shared<Args>();
  synth
      ->add_option("--task", a->o.task,
                   "arithmetic (a correct sum against a wrong one) or case (the reply in the "
                   "letter case the prompt asks for against the other)")
      ->check(CLI::IsMember({"arithmetic", "case"}))
      ->capture_default_str();
  // Every pair is made in memory before the file is written.
  synth->add_option("--count", a->o.count, "Pairs to write (1 to 10000000)")
      ->check(CLI::Range(int64_t{1}, int64_t{10'000'000}))
      ->capture_default_str();
  synth->add_option("--seed", a->o.seed, "Random seed")
      ->check(seed_number())
      ->capture_default_str();
  synth->add_option("--digits", a->o.digits, "arithmetic: operands of at most this many digits")
      ->check(CLI::Range(1, 9))
      ->capture_default_str();
  synth->add_flag("--text", a->text,
                  "Prompts as plain text (\"Question: ...\\nAnswer: \") instead of chat messages");
  if (responses_option)
    synth->add_flag("--responses", a->o.responses,
                    "Write prompt/response records (both replies, with \"preferred\") to score "
                    "with `pollen rm score`");
  synth->add_option("--out", a->out, "JSONL file to write")->required();
  synth->callback([a] {
    a->o.messages = !a->text;
    train::write_preference_synth(a->o, a->out);
    std::printf("wrote %lld %s to %s\n", static_cast<long long>(a->o.count),
                a->o.responses ? "prompts (two responses each)" : "pairs", a->out.c_str());
  });
}

void add_rm_score(CLI::App* cmd) {
  auto* score = cmd->add_subcommand(
      "score",
      "Score prompt/response JSONL with a reward model (an HF sequence-classification "
      "directory); each record is written back with a \"score\" field");
  struct Args {
    std::string model, data, out, chat_template;
    int64_t micro_batch = 8, max_seq = 0;
  };
  auto a = std::make_shared<Args>();
  score->add_option("--model", a->model, "Reward model directory (LlamaForSequenceClassification)")
      ->required();
  score->add_option("--data", a->data, "JSONL records {\"prompt\", \"response\"}")->required();
  score->add_option("--out", a->out, "JSONL file to write")->required();
  score->add_option("--chat-template", a->chat_template,
                    "chatml or llama3, for prompts given as messages (default: the one the "
                    "model's tokenizer_config.json names)");
  score->add_option("--micro-batch", a->micro_batch, "Sequences per forward pass")
      ->capture_default_str();
  score
      ->add_option("--max-seq", a->max_seq,
                   "Longest sequence, at most the model's max_position_embeddings (the default); "
                   "a longer record loses the start of its prompt")
      ->check(CLI::PositiveNumber);
  score->callback([a] {
    const std::filesystem::path dir = a->model;
    POLLEN_CHECK(a->micro_batch > 0, "--micro-batch must be positive");
    const train::RewardModel rm = train::load_reward_model(dir);
    const int64_t positions = rm.decoder->config().max_position_embeddings;
    POLLEN_CHECK(a->max_seq <= positions, "--max-seq ", a->max_seq, " is more than the model's ",
                 positions, " positions (max_position_embeddings)");
    const tokenizer::Tokenizer tok = tokenizer::open_tokenizer(dir / "tokenizer.json", "");
    train::SequenceFormat format{&tok, std::nullopt, a->max_seq > 0 ? a->max_seq : positions};
    const auto config = dir / "tokenizer_config.json";
    if (!a->chat_template.empty() ||
        (std::filesystem::exists(config) &&
         read_file(config).find("\"chat_template\"") != std::string::npos))
      format.chat_format = chosen_chat_format(dir, a->chat_template);
    const train::ScoreCounts counts =
        train::score_jsonl(rm, format, a->data, a->out, a->micro_batch);
    std::printf("scored %lld records of %s with %s -> %s\n", static_cast<long long>(counts.records),
                a->data.c_str(), a->model.c_str(), a->out.c_str());
    if (counts.shortened > 0)
      log::warn(counts.shortened, " of them longer than ", format.max_seq,
                " positions: scored on their response's first tokens and their prompt's last "
                "(--max-seq)");
  });
}

}  // namespace

void add_dpo_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "dpo", std::string("Direct preference optimisation (DPO, IPO) on prompt/chosen/rejected "
                         "pairs as one TOML run file describes (docs/posttraining.md).") +
                 kPostExitCodes + kPostDataParallel);
  add_synth(cmd, false);
  add_post_run_options(cmd, "dpo", "dpo.batch_pairs=16",
                       [](const train::PostConfig& cfg, const train::PostOptions& o) {
                         return train::run_post_training(cfg, o, train::make_dpo_objective);
                       });
}

void add_rm_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "rm", std::string("Reward model: a scalar head on the decoder trained on preference pairs "
                        "(Bradley-Terry) as one TOML run file describes (docs/posttraining.md); "
                        "a finished run is exported to run.dir/reward_model as an HF "
                        "sequence-classification directory.") +
                kPostExitCodes + kPostDataParallel);
  add_synth(cmd, true);
  add_rm_score(cmd);
  add_post_run_options(
      cmd, "rm", "rm.batch_pairs=16",
      [](const train::PostConfig& cfg, const train::PostOptions& o) {
        uint32_t pad_token_id = 0;
        const train::PostResult r =
            train::run_post_training(cfg, o, [&](const train::ObjectiveContext& ctx) {
              auto rm = std::make_unique<train::RewardObjective>(ctx);
              pad_token_id = rm->pad_token_id();
              return std::unique_ptr<train::Objective>(std::move(rm));
            });
        // Rank 0 of several writes the run's files, the export among them.
        const bool lead = o.comm == nullptr || o.comm->rank() == 0;
        if (r.status == train::RunStatus::finished && lead) {
          const auto out = cfg.dir / "reward_model";
          train::export_reward_checkpoint(r.last_checkpoint, pad_token_id, out);
          log::info("reward model exported to '", out.string(),
                    "' (LlamaForSequenceClassification)");
        }
        // The other ranks wait for it with no watchdog: the end of their job
        // has one, which a long export would outlast.
        if (r.status == train::RunStatus::finished && o.comm && o.comm->world() > 1) {
          int64_t exported[1] = {1};
          o.comm->wait_for_broadcast(exported, 0, "the reward model's export");
        }
        return r;
      });
}

}  // namespace pollen::cli
