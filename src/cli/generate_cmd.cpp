// `pollen generate --model M --prompt TEXT [...]`: wiring only; generation is model::generate.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/thread_pool.h"
#include "base/utf8.h"
#include "cli/commands.h"
#include "cli/model_args.h"
#include "cli/sampling_args.h"
#include "model/generate.h"

namespace pollen::cli {

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Continue one or more prompts with a model");
  struct Args {
    std::string model, adapter, tokenizer;
    std::vector<std::string> prompts;
    SamplingArgs sampling;
    bool no_cache = false, json = false, ignore_eos = false;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, kModelHelp)->required();
  cmd->add_option("--adapter", a->adapter, kAdapterHelp);
  cmd->add_option("--prompt", a->prompts, "Prompt text (repeat for a batch)")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: the model's)");
  add_sampling_options(cmd, a->sampling);
  cmd->add_flag("--ignore-eos", a->ignore_eos, "Do not stop at end-of-sequence tokens");
  cmd->add_flag("--no-cache", a->no_cache, "Recompute the whole sequence every token");
  cmd->add_flag("--json", a->json, "One JSON object per prompt (tokens, text, finish_reason)");
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)");
  cmd->callback([a] {
    if (a->threads > 0) set_num_threads(a->threads);
    const io::ModelSource src = io::resolve_model(a->model);
    const tokenizer::Tokenizer tok = model_tokenizer(src, a->tokenizer);
    const model::Llama m = load_model_with_adapter(src, a->adapter);
    check_tokenizer_fits(tok, src, a->tokenizer);
    model::SamplingOptions o = a->sampling.resolved(tok);
    o.use_cache = !a->no_cache;
    if (!a->ignore_eos) o.stop_tokens = stop_tokens(src, tok);
    std::vector<std::vector<uint32_t>> prompts;
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    eo.add_bos_eos = true;
    for (const auto& p : a->prompts) {
      auto ids = tok.encode(p, eo);
      // The post-processor's suffix (an EOS) would end the prompt; generation continues the text.
      const auto& suffix = tok.bos_eos().suffix;
      if (!suffix.empty() && ids.size() >= suffix.size()) ids.resize(ids.size() - suffix.size());
      // The model has positions for the prompt and the tokens asked for, no more; dynamic rope
      // scaling is made to stretch them.
      const int64_t context = m.config().max_position_embeddings;
      const auto needed = static_cast<int64_t>(ids.size()) + o.max_tokens;
      const bool stretches = m.config().rope_scaling.kind == ops::RopeScaling::Kind::dynamic;
      const std::string shown = p.size() > 40 ? p.substr(0, 40) + "..." : p;
      POLLEN_CHECK(stretches || static_cast<int64_t>(ids.size()) < context, "the prompt '", shown,
                   "' takes ", ids.size(), " tokens, and the model has ", context,
                   " positions (max_position_embeddings): shorten the prompt");
      POLLEN_CHECK(stretches || needed <= context, "--max-tokens ", o.max_tokens,
                   " after the prompt '", shown, "' (", ids.size(), " tokens) needs ", needed,
                   " positions; the model has ", context,
                   " (max_position_embeddings): ask for at most ",
                   context - static_cast<int64_t>(ids.size()), " tokens");
      prompts.push_back(std::move(ids));
    }
    const auto gens = model::generate(
        m, prompts, o, [&](std::span<const uint32_t> ids) { return tok.generated_text(ids); });
    for (size_t i = 0; i < gens.size(); ++i) {
      if (a->json) {
        nlohmann::json j = {{"prompt", a->prompts[i]},
                            {"tokens", gens[i].tokens},
                            {"text", gens[i].text},
                            {"finish_reason", gens[i].finish_reason}};
        std::printf("%s\n",
                    j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
      } else {
        // The text whole (a generated NUL byte too), bytes that are not UTF-8 as U+FFFD, as
        // HF's decode gives them.
        std::string line;
        utf8_repair(a->prompts[i] + gens[i].text + "\n", line);
        std::fwrite(line.data(), 1, line.size(), stdout);
      }
    }
  });
}

}  // namespace pollen::cli
