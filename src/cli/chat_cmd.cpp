// `pollen chat --model M [--system TEXT] [--chat-template chatml|llama3] [sampling options]`:
// wiring only; templates are tokenizer::render_chat, generation model::Continuation.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "base/utf8.h"
#include "cli/commands.h"
#include "cli/model_args.h"
#include "cli/sampling_args.h"
#include "model/continuation.h"
#include "tokenizer/chat_template.h"

namespace pollen::cli {
void add_chat_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "chat",
      "Talk with a model: one message per line on stdin, the reply streamed to stdout; the "
      "conversation is kept until end of input (Ctrl-D), its oldest exchanges left out when it "
      "outgrows --context");
  struct Args {
    std::string model, adapter, tokenizer, system, chat_template;
    SamplingArgs sampling;
    int64_t context = 0;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  a->sampling.options.max_tokens = 512;
  cmd->add_option("--model", a->model, kModelHelp)->required();
  cmd->add_option("--adapter", a->adapter, kAdapterHelp);
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: the model's)");
  cmd->add_option("--system", a->system, "System message that opens the conversation");
  cmd->add_option("--chat-template", a->chat_template,
                  "chatml or llama3 (default: the one a post-training checkpoint names, else the "
                  "model's tokenizer_config.json)")
      ->check(CLI::IsMember({"chatml", "llama3"}));
  add_sampling_options(cmd, a->sampling);
  cmd->add_option("--context", a->context,
                  "Most tokens the conversation may hold, its KV cache allocated up front "
                  "(default: the model's max_position_embeddings, at most 8192; more only with "
                  "dynamic rope scaling)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)");
  cmd->callback([a] {
    if (a->threads > 0) set_num_threads(a->threads);
    const io::ModelSource src = io::resolve_model(a->model);
    const tokenizer::Tokenizer tok = model_tokenizer(src, a->tokenizer);
    const tokenizer::ChatFormat format = model_chat_format(src, a->chat_template);
    const model::Llama m = load_model_with_adapter(src, a->adapter);
    check_tokenizer_fits(tok, src, a->tokenizer);
    model::SamplingOptions o = a->sampling.resolved(tok);
    o.stop_tokens = stop_tokens(src, tok);
    o.stop_tokens.push_back(end_of_turn_id(tok, format));
    tokenizer::EncodeOptions eo;  // the template writes BOS itself where the model wants one
    eo.special = tokenizer::SpecialPolicy::allow_all();
    const auto decode = [&](std::span<const uint32_t> ids) { return tok.generated_text(ids); };
    // The cache is allocated whole: a 131072-token default would take 34 GB on an 8B model.
    const int64_t positions = m.config().max_position_embeddings;
    const bool stretches = m.config().rope_scaling.kind == ops::RopeScaling::Kind::dynamic;
    POLLEN_CHECK(stretches || a->context <= positions, "--context ", a->context,
                 " is more than the model's ", positions,
                 " positions (max_position_embeddings); its dynamic rope scaling alone would "
                 "stretch them");
    const int64_t context = a->context > 0 ? a->context : std::min<int64_t>(positions, 8192);
    model::Continuation session(m, context, o.seed);
    // A reply may take --max-tokens or what the context leaves after the conversation. When that
    // is less than min(--max-tokens, context / 2), the oldest exchanges (a message and its reply)
    // are left out; a message that does not fit even alone is not sent, and the chat goes on.
    const int64_t room_wanted = std::max<int64_t>(1, std::min<int64_t>(o.max_tokens, context / 2));
    const size_t first_turn = a->system.empty() ? 0 : 1;

    const bool interactive = isatty(STDIN_FILENO);
    std::vector<tokenizer::ChatMessage> messages;
    if (!a->system.empty()) messages.push_back({"system", a->system});
    std::string line;
    while (true) {
      if (interactive) {
        std::fputs("> ", stdout);
        std::fflush(stdout);
      }
      if (!std::getline(std::cin, line)) break;
      if (line.empty()) continue;
      // The conversation with the new message, its oldest exchanges left out as needed; kept
      // only when the message is sent.
      std::vector<tokenizer::ChatMessage> sent = messages;
      sent.push_back({"user", line});
      const auto render = [&] {
        return tok.encode(tokenizer::render_chat(format, sent, true), eo);
      };
      std::vector<uint32_t> ids = render();
      int64_t left_out = 0;
      while (static_cast<int64_t>(ids.size()) + room_wanted > context &&
             sent.size() > first_turn + 1) {
        sent.erase(sent.begin() + static_cast<std::ptrdiff_t>(first_turn),
                   sent.begin() + static_cast<std::ptrdiff_t>(first_turn + 2));
        ++left_out;
        ids = render();
      }
      if (static_cast<int64_t>(ids.size()) >= context) {
        std::fprintf(stderr,
                     "[not sent: this message takes %zu tokens in the template, and the context "
                     "holds %lld (--context)]\n",
                     ids.size(), static_cast<long long>(context));
        std::fputc('\n', stdout);  // its empty reply: one line per message, as ever
        std::fflush(stdout);
        continue;
      }
      messages = std::move(sent);
      if (left_out > 0)
        std::fprintf(stderr,
                     "[the %lld oldest exchange%s left out to fit the context of %lld tokens]\n",
                     static_cast<long long>(left_out), left_out == 1 ? " is" : "s are",
                     static_cast<long long>(context));
      model::SamplingOptions turn = o;
      turn.max_tokens = std::min<int64_t>(o.max_tokens, context - static_cast<int64_t>(ids.size()));
      const model::Generation reply = session.generate(ids, turn, decode, [](std::string_view t) {
        std::string shown;  // bytes that are not UTF-8 (a reply cut inside a character) as U+FFFD
        utf8_repair(t, shown);
        std::fwrite(shown.data(), 1, shown.size(), stdout);
        std::fflush(stdout);
      });
      std::fputc('\n', stdout);
      std::fflush(stdout);
      messages.push_back({"assistant", reply.text});
      if (interactive)
        std::fprintf(stderr, "[%zu tokens%s; %lld of the prompt's %zu from the cache]\n",
                     reply.tokens.size(),
                     reply.finish_reason != "length"  ? ""
                     : turn.max_tokens < o.max_tokens ? ", cut at the context's end"
                                                      : ", cut at --max-tokens",
                     static_cast<long long>(session.reused_tokens()), ids.size());
    }
  });
}

}  // namespace pollen::cli
