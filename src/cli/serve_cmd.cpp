// `pollen serve --model M [--port P] [--host H --api-key K]`: wiring only; the server is
// serve::Server.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "base/host_port.h"
#include "base/thread_pool.h"
#include "cli/commands.h"
#include "cli/model_args.h"
#include "serve/server.h"

namespace pollen::cli {
namespace {

// SIGINT or SIGTERM stops the server taking requests, and those running finish (their streams
// end as usual); a second signal ends the process at once. The handler only writes to a pipe
// (stopping the server is not async-signal-safe), which a thread of its own reads.
int g_stop_pipe[2] = {-1, -1};
std::atomic<int> g_signals{0};

void on_signal(int sig) {
  if (g_signals.fetch_add(1) > 0) std::_Exit(128 + sig);
  const char stop = 1;
  [[maybe_unused]] const ssize_t n = write(g_stop_pipe[1], &stop, 1);
}

// Stops the server at the first signal while it lives.
class StopOnSignal {
 public:
  explicit StopOnSignal(serve::Server& server) {
    POLLEN_CHECK(pipe(g_stop_pipe) == 0, "serve: cannot make a pipe: ", std::strerror(errno));
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    thread_ = std::thread([&server] {
      char what = 0;
      while (read(g_stop_pipe[0], &what, 1) < 0 && errno == EINTR) {
      }
      if (what != 1) return;  // 0: the server ended otherwise
      std::fprintf(stderr,
                   "pollen serve: stopping: no new requests, those running finish first (signal "
                   "again to end at once)\n");
      server.stop_gracefully();
    });
  }
  ~StopOnSignal() {
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    const char ended = 0;
    [[maybe_unused]] const ssize_t n = write(g_stop_pipe[1], &ended, 1);
    thread_.join();
    close(g_stop_pipe[0]);
    close(g_stop_pipe[1]);
  }
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

 private:
  std::thread thread_;
};

// The key `source` (--api-key, or the file) gives: its text without surrounding whitespace. A
// request's header cannot carry whitespace inside a key (HTTP trims it around one), so a key
// with some, a file's second line say, would refuse every request: refused here instead.
std::string api_key_from(const std::string& text, const std::string& source) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  const std::string key = text.substr(first, text.find_last_not_of(" \t\r\n") - first + 1);
  POLLEN_CHECK(key.find_first_of(" \t\r\n") == std::string::npos, source,
               " holds whitespace inside the key (a second line?): give the key alone, on one "
               "line");
  return key;
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "serve",
      "Serve a model over an OpenAI-compatible HTTP API: /v1/completions (with echo and "
      "logprobs, as lm-evaluation-harness's local-completions needs), /v1/chat/completions "
      "(streaming too, and logprobs), /v1/models, /health, /metrics (Prometheus)");
  struct Args {
    std::string model, tokenizer, host = "127.0.0.1", api_key, api_key_file, name, chat_template;
    int port = 8000;
    serve::Limits limits;
    int64_t max_batch_rows = 16, prefill_chunk = 256;
    int threads = 0;
    std::vector<std::string> allowed_origins;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, kModelHelp)->required();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: the model's)");
  cmd->add_option("--host", a->host,
                  "Address to listen on; any other than 127.0.0.1, ::1 or localhost needs an API "
                  "key")
      ->capture_default_str();
  cmd->add_option("--port", a->port, "Port to listen on (0: any free one, printed at start)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  auto* key = cmd->add_option("--api-key", a->api_key,
                              "Key every request must send as 'Authorization: Bearer KEY'");
  cmd->add_option("--api-key-file", a->api_key_file, "File holding the API key (one line)")
      ->check(CLI::ExistingFile)
      ->excludes(key);
  cmd->add_option("--allowed-origins", a->allowed_origins,
                  "Origins whose web pages may call the API (CORS), comma-separated: "
                  "scheme://host[:port] each, or * for any (default: none)")
      ->delimiter(',');
  cmd->add_option("--name", a->name, "Model name in the API (default: --model as given)");
  cmd->add_option("--chat-template", a->chat_template,
                  "chatml or llama3 (default: the one a post-training checkpoint names, else the "
                  "model's tokenizer_config.json)")
      ->check(CLI::IsMember({"chatml", "llama3"}));
  cmd->add_option("--max-body-bytes", a->limits.max_body_bytes, "Largest request body")
      ->check(one_or_more())
      ->capture_default_str();
  cmd->add_option("--max-prompt-tokens", a->limits.max_prompt_tokens,
                  "Longest prompt in tokens (0: the model's context)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--max-tokens", a->limits.max_tokens, "Most tokens generated per prompt")
      ->check(one_or_more())
      ->capture_default_str();
  cmd->add_option("--max-prompts", a->limits.max_prompts,
                  "Most choices in one request (prompts times n)")
      ->check(one_or_more())
      ->capture_default_str();
  cmd->add_option("--max-concurrent", a->limits.max_concurrent,
                  "Most requests in flight; more are answered 429")
      ->check(one_or_more())
      ->capture_default_str();
  cmd->add_option(
         "--max-batch-rows", a->max_batch_rows,
         "Most sequences generated at once (requests join the running batch as rows free up)")
      ->check(one_or_more())
      ->capture_default_str();
  cmd->add_option("--prefill-chunk", a->prefill_chunk,
                  "Most prompt tokens one step runs, so that a long prompt joining the batch "
                  "stalls the streams already running for no longer (0: whole prompts)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)")->check(CLI::NonNegativeNumber);
  cmd->callback([a, key] {
    if (a->threads > 0) set_num_threads(a->threads);
    serve::ServerOptions o;
    o.host = a->host;
    o.port = a->port;
    if (a->api_key_file.empty()) {
      o.api_key = api_key_from(a->api_key, "--api-key");
      // `--api-key "$KEY"` with KEY unset would serve without a key.
      POLLEN_CHECK(key->count() == 0 || !o.api_key.empty(),
                   "--api-key is empty; pass the key (or leave --api-key out to serve without "
                   "one on a loopback address)");
    } else {
      const std::string source = cat("API key file '", a->api_key_file, "'");
      o.api_key = api_key_from(read_file(a->api_key_file), source);
      POLLEN_CHECK(!o.api_key.empty(), source, " is empty");
    }
    serve::check_bind(o.host, o.api_key);  // before the model loads
    serve::check_allowed_origins(a->allowed_origins);
    o.allowed_origins = a->allowed_origins;
    const io::ModelSource src = io::resolve_model(a->model);
    const tokenizer::Tokenizer tok = model_tokenizer(src, a->tokenizer);
    const model::Llama m = io::load_model(src);
    check_tokenizer_fits(tok, src, a->tokenizer);
    o.model.name = a->name.empty() ? a->model : a->name;
    o.model.context = m.config().max_position_embeddings;
    o.model.stop_tokens = stop_tokens(src, tok);
    o.model.bos = reported_bos(src, tok);
    o.model.eos = special_ids(src, tok).eos;
    o.limits = a->limits;
    o.max_batch_rows = a->max_batch_rows;
    o.prefill_chunk = a->prefill_chunk;
    try {
      o.chat = model_chat_format(src, a->chat_template);
      // As pollen chat: a template the tokenizer cannot end is refused.
      o.model.end_of_turn = end_of_turn_id(tok, *o.chat);
    } catch (const Error& e) {
      o.chat.reset();
      if (!a->chat_template.empty()) throw;
      std::fprintf(stderr, "pollen serve: chat completions are off: %s\n", e.what());
    }
    serve::Server server(m, tok, o);
    const StopOnSignal stopper(server);
    std::printf("pollen serve: '%s' on http://%s\n", o.model.name.c_str(),
                url_host_port(o.host, server.port()).c_str());
    std::fflush(stdout);
    server.run();
  });
}

}  // namespace pollen::cli
