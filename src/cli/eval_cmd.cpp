// `pollen eval --model M [--checkpoint DIR] (--data manifest.json... | --text FILE | --jsonl FILE |
// --task FILE.jsonl)`, `pollen eval --run RUN_DIR [--data manifest.json...] [--again]` (every
// checkpoint of a run) and `pollen score --model M --input FILE --output F.jsonl`: wiring only;
// the scoring is eval/perplexity (token shards, batched), eval/rolling (raw text, rolling
// windows), eval/multiple_choice (tasks) and train/run_eval (a run's checkpoints).

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/json_depth.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "base/utf8.h"
#include "cli/commands.h"
#include "cli/model_args.h"
#include "data/loader.h"
#include "data/shards.h"
#include "eval/multiple_choice.h"
#include "eval/perplexity.h"
#include "eval/rolling.h"
#include "obs/progress.h"
#include "train/run_eval.h"

namespace pollen::cli {
namespace {

// Documents of a text input: the whole file, or one per line (JSONL: the given string field).
// A blank JSONL line is skipped, or with `per_line` an empty document (so that output lines stay
// those of the input).
std::vector<std::string> read_documents(const std::string& path, bool jsonl,
                                        const std::string& field, bool per_line) {
  std::vector<std::string> docs;
  // Bits per byte count the text's UTF-8 bytes, and the tokenizer reads UTF-8.
  const auto check_utf8 = [&](std::string_view text, int64_t line) {
    size_t bad = utf8_invalid_at(text);
    if (bad == std::string_view::npos) return;
    if (line == 0) {  // a whole file: the line and the byte in it
      const std::string_view before = text.substr(0, bad);
      line = 1 + std::count(before.begin(), before.end(), '\n');
      const size_t start = before.rfind('\n');
      if (start != std::string_view::npos) bad -= start + 1;
    }
    fail("'", path, "' line ", line, ": not valid UTF-8 at byte ", bad + 1);
  };
  if (!jsonl && !per_line) {
    docs.push_back(read_file(path));
    check_utf8(docs.back(), 0);
    return docs;
  }
  std::ifstream in(path);
  POLLEN_CHECK(in.good(), "cannot open '", path, "'");
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!jsonl) {
      if (line.ends_with('\r')) line.pop_back();  // a Windows line break is no document text
      check_utf8(line, n);
      docs.push_back(line);
      continue;
    }
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      if (per_line) docs.emplace_back();
      continue;
    }
    const auto j = parse_json_object(line, cat("'", path, "' line ", n));
    POLLEN_CHECK(j.contains(field) && j[field].is_string(), "'", path, "' line ", n,
                 ": no string field '", field, "'");
    docs.push_back(j[field].get<std::string>());
  }
  POLLEN_CHECK(!in.bad(), "cannot read '", path, "'");
  return docs;
}

// lm-evaluation-harness's max_length for an HF model: the config's max_position_embeddings. A
// longer --window would score positions the model never had.
int64_t default_window(const model::LlamaConfig& c, int64_t given, const char* command) {
  POLLEN_CHECK(given <= c.max_position_embeddings, command, ": --window ", given,
               " is longer than the model reads (max_position_embeddings ",
               c.max_position_embeddings, "); give --window ", c.max_position_embeddings,
               " or less");
  return given > 0 ? given : c.max_position_embeddings;
}

struct TaskArgs {
  std::string task, fewshot_file, details;
  int64_t fewshot = 0;
  uint64_t seed = 1234;
};

// An option given for a mode other than the one run would be ignored: refused instead, naming the
// modes it serves.
using ModeScopes = std::vector<std::pair<CLI::Option*, std::vector<std::string>>>;
void check_mode_options(const std::string& mode, const ModeScopes& scopes) {
  for (const auto& [option, modes] : scopes) {
    if (option->count() == 0 || std::find(modes.begin(), modes.end(), mode) != modes.end())
      continue;
    std::string listed = modes.front();  // "--a, --b or --c"
    for (size_t i = 1; i < modes.size(); ++i)
      listed += (i + 1 == modes.size() ? " or " : ", ") + modes[i];
    fail("eval: ", option->get_name(), " applies to ", listed, ", not to ", mode);
  }
}

// A multiple-choice task: the result JSON, and per-item lines in `details` when asked.
nlohmann::ordered_json run_task(const model::Llama& m, const io::ModelSource& src,
                                const tokenizer::Tokenizer& tok, const TaskArgs& t, int64_t window,
                                int64_t batch, std::string* details) {
  const auto items = eval::read_choice_items(t.task);
  std::vector<eval::ChoiceItem> pool;
  if (!t.fewshot_file.empty()) pool = eval::read_choice_items(t.fewshot_file);
  eval::ChoiceEvalOptions o;
  o.fewshot = t.fewshot;
  o.seed = t.seed;
  o.fewshot_pool = pool;
  o.prefix = lm_eval_prefix_token(src, tok);
  o.max_len = window;
  o.batch = batch;
  std::optional<obs::Progress> progress;  // once the pairs are counted; a line a tenth off a tty
  o.on_batch = [&](size_t done, size_t pairs) {
    const auto passes =
        static_cast<int64_t>((pairs + static_cast<size_t>(batch) - 1) / static_cast<size_t>(batch));
    if (!progress) progress.emplace("eval task", static_cast<int64_t>(pairs), 0, passes / 10);
    progress->update(static_cast<int64_t>(done), "choices scored");
  };
  const eval::ChoiceEvalResult r = eval::evaluate_choices(m, tok, items, o);
  if (progress) progress->finish();
  const auto stderr_json = [](const std::optional<double>& v) {
    return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
  };
  nlohmann::ordered_json j;
  j["task"] = t.task;
  j["items"] = r.metrics.items;
  j["fewshot"] = t.fewshot;
  j["acc"] = r.metrics.acc;
  j["acc_stderr"] = stderr_json(r.metrics.acc_stderr);
  j["acc_norm"] = r.metrics.acc_norm;
  j["acc_norm_stderr"] = stderr_json(r.metrics.acc_norm_stderr);
  j["seconds"] = r.seconds;
  if (details) {
    std::string& lines = *details;
    for (size_t i = 0; i < items.size(); ++i) {
      const eval::ItemResult& it = r.items[i];
      nlohmann::ordered_json d{{"index", i},
                               {"context", r.contexts[i]},
                               {"choices", items[i].choices},
                               {"gold", items[i].gold},
                               {"logprobs", it.logprobs},
                               {"lengths", it.lengths},
                               {"pred", it.pred},
                               {"pred_norm", it.pred_norm},
                               {"acc", it.correct ? 1 : 0},
                               {"acc_norm", it.correct_norm ? 1 : 0}};
      lines += d.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    }
  }
  return j;
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "eval",
      "Loss and perplexity of a model on token shards (one JSON line per manifest, every token "
      "scored once), or loss, perplexity and bits per byte on raw text (long texts in rolling "
      "windows, each token scored once, as lm-evaluation-harness's loglikelihood_rolling), or acc "
      "and acc_norm on a multiple-choice task (log-likelihood of each choice, as "
      "lm-evaluation-harness scores them). With --run: every checkpoint of a training run on its "
      "validation data (or --data), written to RUN_DIR/eval.jsonl and TensorBoard");
  struct Args {
    std::string model, run, checkpoint, tokenizer, split = "validation", text, jsonl,
                                                   field = "text", output;
    bool again = false;
    std::vector<std::string> data;
    int64_t window = 0, max_docs = 0, seq = 128, batch = 8;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  auto t = std::make_shared<TaskArgs>();
  auto* model = cmd->add_option("--model", a->model, kModelHelp);
  auto* run = cmd->add_option("--run", a->run,
                              "A run folder of pollen train: evaluate each of its checkpoints "
                              "that verifies (by default on the run's validation data, rows of "
                              "its train.seq) into RUN_DIR/eval.jsonl, skipping those done")
                  ->check(CLI::ExistingDirectory);
  model->excludes(run);
  auto* again =
      cmd->add_flag("--again", a->again, "--run: evaluate checkpoints already in eval.jsonl again");
  auto* checkpoint =
      cmd->add_option("--checkpoint", a->checkpoint,
                      "Weights to score instead of --model's own: a checkpoint folder of pollen "
                      "train or pollen fed, or a .safetensors file")
          ->check(CLI::ExistingPath);
  auto* tokenizer = cmd->add_option("--tokenizer", a->tokenizer,
                                    "tokenizer.json for text (default: the model's)");
  auto* data = cmd->add_option("--data", a->data, "manifest.json files of token shards")
                   ->check(CLI::ExistingFile);
  auto* split = cmd->add_option("--split", a->split, "Split of --data")->capture_default_str();
  auto* seq = cmd->add_option("--seq", a->seq, "--data: tokens per row; longer documents in pieces")
                  ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
                  ->capture_default_str();
  auto* batch = cmd->add_option("--batch", a->batch,
                                "--data: rows per forward pass; --task: choices per pass")
                    ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
                    ->capture_default_str();
  auto* text = cmd->add_option("--text", a->text, "A text file, scored as one document")
                   ->check(CLI::ExistingFile);
  auto* jsonl = cmd->add_option("--jsonl", a->jsonl, "JSONL file, one document per line")
                    ->check(CLI::ExistingFile);
  auto* field =
      cmd->add_option("--field", a->field, "String field of --jsonl")->capture_default_str();
  auto* task = cmd->add_option("--task", t->task,
                               "Multiple-choice task: JSONL of {\"context\", \"choices\", "
                               "\"gold\"} objects")
                   ->check(CLI::ExistingFile);
  data->excludes(text)->excludes(jsonl)->excludes(task);
  text->excludes(jsonl)->excludes(task);
  jsonl->excludes(task);
  run->excludes(text)->excludes(jsonl)->excludes(task)->excludes(checkpoint);
  auto* fewshot = cmd->add_option("--fewshot", t->fewshot, "Task: examples before each item")
                      ->check(CLI::NonNegativeNumber)
                      ->capture_default_str();
  auto* fewshot_file =
      cmd->add_option(
             "--fewshot-file", t->fewshot_file,
             "Task: JSONL to draw examples from (default: the task, never the item itself)")
          ->check(CLI::ExistingFile);
  auto* fewshot_seed =
      cmd->add_option("--fewshot-seed", t->seed, "Task: seed of the examples drawn")
          ->check(seed_number())
          ->capture_default_str();
  auto* details =
      cmd->add_option("--details", t->details, "Task: write one JSON line per item here");
  auto* window =
      cmd->add_option("--window", a->window,
                      "Text and task: tokens per window (default: the model's context, as lm-eval)")
          ->check(CLI::NonNegativeNumber);
  auto* max_docs =
      cmd->add_option("--max-docs", a->max_docs, "Text: score at most this many documents (0: all)")
          ->check(CLI::NonNegativeNumber);
  auto* output = cmd->add_option(
      "--output", a->output,
      "Data, text and task: also write the result here (--data: one JSON line per manifest)");
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)");
  const ModeScopes scopes = {{again, {"--run"}},
                             {checkpoint, {"--data", "--text", "--jsonl", "--task"}},
                             {tokenizer, {"--text", "--jsonl", "--task"}},
                             {split, {"--data", "--run"}},
                             {seq, {"--data", "--run"}},
                             {batch, {"--data", "--run", "--task"}},
                             {field, {"--jsonl"}},
                             {fewshot, {"--task"}},
                             {fewshot_file, {"--task"}},
                             {fewshot_seed, {"--task"}},
                             {details, {"--task"}},
                             {window, {"--text", "--jsonl", "--task"}},
                             {max_docs, {"--text", "--jsonl"}},
                             {output, {"--data", "--text", "--jsonl", "--task"}}};
  cmd->callback([a, t, split, seq, batch, scopes] {
    if (a->threads > 0) set_num_threads(a->threads);
    const std::string mode = !a->run.empty()     ? "--run"
                             : !a->data.empty()  ? "--data"
                             : !a->text.empty()  ? "--text"
                             : !a->jsonl.empty() ? "--jsonl"
                             : !t->task.empty()  ? "--task"
                                                 : "";
    if (!mode.empty()) check_mode_options(mode, scopes);
    check_writable(a->output, "--output");
    check_writable(t->details, "--details");
    if (!a->run.empty()) {
      train::RunEvalOptions o;
      o.manifests = a->data;
      if (split->count() > 0) o.split = a->split;
      if (seq->count() > 0) o.seq = a->seq;
      if (batch->count() > 0) o.batch = a->batch;
      o.again = a->again;
      const train::RunEvalResult r = train::evaluate_run(a->run, o);
      for (const auto& j : r.evaluated) std::printf("%s\n", j.dump().c_str());
      log::info("evaluated ", r.evaluated.size(), " (checkpoint, dataset) pairs into '",
                (std::filesystem::path(a->run) / "eval.jsonl").string(), "'; ", r.already,
                " already there",
                r.unverified.empty()
                    ? ""
                    : cat("; ", r.unverified.size(), " checkpoints did not verify"));
      return;
    }
    POLLEN_CHECK(!a->model.empty(), "eval: give --model (or --run)");
    POLLEN_CHECK(!a->data.empty() || !a->text.empty() || !a->jsonl.empty() || !t->task.empty(),
                 "eval: give --data, --text, --jsonl or --task");
    const io::ModelSource src = io::resolve_model(a->model);
    const model::Llama m = io::load_model(src);
    if (!a->checkpoint.empty()) eval::load_weights(m, a->checkpoint);
    // What the results are of: the model, and the checkpoint whose weights were scored (a run
    // folder's newest, which moves on while the run trains).
    const auto scored_model = [&] {
      nlohmann::ordered_json j{{"model", a->model}};
      if (!a->checkpoint.empty())
        j["checkpoint"] = a->checkpoint;
      else if (src.kind == io::ModelSource::Kind::checkpoint &&
               std::filesystem::path(a->model).lexically_normal() != src.path.lexically_normal())
        j["checkpoint"] = src.path.string();
      return j;
    };
    if (!a->data.empty()) {
      POLLEN_CHECK(a->seq <= m.config().max_position_embeddings, "eval: --seq ", a->seq,
                   seq->count() > 0 ? "" : " (its default)", " is longer than model '", a->model,
                   "' reads (max_position_embeddings ", m.config().max_position_embeddings,
                   "); give --seq ", m.config().max_position_embeddings, " or less");
      if (src.tokenizer) {
        const std::string fingerprint = model_tokenizer(src, "").fingerprint();
        for (const std::string& manifest : a->data)
          data::check_tokenized_by(data::Manifest::load(manifest), fingerprint,
                                   src.tokenizer->string());
      }
      std::string lines;
      for (const std::string& manifest : a->data) {
        const eval::PerplexityResult r =
            eval::perplexity(m, manifest, {a->split, a->seq, a->batch});
        POLLEN_CHECK(r.tokens > 0, "eval: '", manifest, "' split '", a->split,
                     "' has no document of two or more tokens to score");
        nlohmann::ordered_json j = scored_model();
        j.update(nlohmann::ordered_json{{"data", manifest},
                                        {"split", a->split},
                                        {"loss", r.loss},
                                        {"perplexity", r.perplexity},
                                        {"tokens", r.tokens},
                                        {"documents", r.documents},
                                        {"seconds", r.seconds}});
        std::printf("%s\n", j.dump().c_str());
        std::fflush(stdout);
        lines += j.dump() + "\n";
      }
      if (!a->output.empty()) write_file_atomic(a->output, lines);
      return;
    }
    const int64_t window_tokens = default_window(m.config(), a->window, "eval");
    const tokenizer::Tokenizer tok = model_tokenizer(src, a->tokenizer);
    check_tokenizer_fits(tok, src, a->tokenizer);
    if (!t->task.empty()) {
      nlohmann::ordered_json result = scored_model();
      std::string item_lines;
      result.update(run_task(m, src, tok, *t, window_tokens, a->batch,
                             t->details.empty() ? nullptr : &item_lines));
      const std::string summary = result.dump(2) + "\n";
      std::printf("%s", summary.c_str());
      std::fflush(stdout);
      if (!a->output.empty()) write_file_atomic(a->output, summary);
      if (!t->details.empty()) write_file_atomic(t->details, item_lines);
      return;
    }
    eval::LossTotals totals;
    nlohmann::ordered_json result = scored_model();
    const bool is_jsonl = !a->jsonl.empty();
    const std::string input = is_jsonl ? a->jsonl : a->text;
    const auto docs = read_documents(input, is_jsonl, a->field, false);
    // lm-evaluation-harness: no BOS or EOS added, special tokens in the text matched as the HF
    // tokenizer matches them, the BOS (else EOS) as the prefix.
    // The first token is conditioned on it, so that every byte of the text is scored.
    const std::optional<uint32_t> prefix = lm_eval_prefix_token(src, tok);
    POLLEN_CHECK(prefix.has_value(),
                 "eval: the tokenizer has no BOS or EOS token to condition a "
                 "document's first token on (lm-evaluation-harness's prefix token)");
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    const auto scoring = static_cast<int64_t>(
        a->max_docs > 0 ? std::min(docs.size(), static_cast<size_t>(a->max_docs)) : docs.size());
    obs::Progress progress("eval text", scoring, 0, std::max<int64_t>(1, scoring / 10));
    for (const auto& doc : docs) {
      if (a->max_docs > 0 && totals.documents >= a->max_docs) break;
      const auto ids = tok.encode(doc, eo);
      if (ids.empty()) continue;
      const std::span<const uint32_t> scored(ids);
      for (double lp : eval::token_logprobs(m, scored, *prefix, window_tokens)) totals.nll -= lp;
      totals.tokens += static_cast<int64_t>(scored.size());
      totals.bytes += static_cast<int64_t>(doc.size());
      ++totals.documents;
      progress.update(totals.documents, cat(totals.tokens, " tokens"));
    }
    progress.finish();
    POLLEN_CHECK(totals.tokens > 0, "eval: '", input, "' holds no text to score",
                 is_jsonl ? cat(" (no line with a non-empty '", a->field, "')") : std::string());
    result["input"] = is_jsonl ? a->jsonl : a->text;
    result["window"] = window_tokens;
    result["documents"] = totals.documents;
    result["tokens"] = totals.tokens;
    result["loss"] = totals.loss();
    result["perplexity"] = totals.perplexity();
    if (totals.bytes > 0) {
      result["bytes"] = totals.bytes;
      result["bits_per_byte"] = totals.bits_per_byte();
    }
    const std::string summary = result.dump(2) + "\n";
    std::printf("%s", summary.c_str());
    if (!a->output.empty()) write_file_atomic(a->output, summary);
  });
}

void add_score_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "score",
      "Per-token log-probabilities of each input line (or JSONL document), one JSON object per "
      "line: {\"tokens\": [ids], \"logprobs\": [null, lp1, ...]}. Tokenised as the tokenizer's "
      "post-processor says (BOS only when it adds one)");
  struct Args {
    std::string model, tokenizer, input, field = "text", output;
    bool jsonl = false;
    int64_t window = 0;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, kModelHelp)->required();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: the model's)");
  cmd->add_option("--input", a->input, "Text file, one document per line")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--jsonl", a->jsonl, "The input is JSONL");
  cmd->add_option("--field", a->field, "String field of JSONL documents")->capture_default_str();
  cmd->add_option("--output", a->output, "JSONL file to write")->required();
  cmd->add_option("--window", a->window,
                  "Tokens per window (default: the model's context, as lm-eval)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)");
  cmd->callback([a] {
    if (a->threads > 0) set_num_threads(a->threads);
    check_writable(a->output, "--output");
    const io::ModelSource src = io::resolve_model(a->model);
    const tokenizer::Tokenizer tok = model_tokenizer(src, a->tokenizer);
    const model::Llama m = io::load_model(src);
    check_tokenizer_fits(tok, src, a->tokenizer);
    const int64_t window = default_window(m.config(), a->window, "score");
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    eo.add_bos_eos = true;
    std::string out;
    for (const auto& doc : read_documents(a->input, a->jsonl, a->field, true)) {
      const auto ids = tok.encode(doc, eo);
      nlohmann::json lps = nlohmann::json::array();
      for (const auto& lp : eval::sequence_logprobs(m, ids, window))
        lps.push_back(lp ? nlohmann::json(*lp) : nlohmann::json(nullptr));
      out += nlohmann::json({{"tokens", ids}, {"logprobs", lps}}).dump() + "\n";
    }
    write_file_atomic(a->output, out);
  });
}

}  // namespace pollen::cli
