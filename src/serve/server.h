#pragma once
// The OpenAI-compatible HTTP server (cpp-httplib): /v1/completions, /v1/chat/completions (whole
// or streamed as server-sent events ending in "data: [DONE]"), /v1/models, /health and
// Prometheus's /metrics (serve/server_metrics.h).
//
// Safety: it binds 127.0.0.1 unless told otherwise and refuses any other address without an API
// key, which every request but /health must then carry as "Authorization: Bearer KEY" (401
// otherwise). Bodies over max_body_bytes get 413, prompts over the token limits and budgets over
// max_tokens 400, and requests beyond max_concurrent in flight 429; every error has OpenAI's
// {"error": {message, type, param, code}} body.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "model/llama.h"
#include "serve/engine.h"
#include "serve/openai.h"
#include "serve/server_metrics.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace pollen::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (see Server::port)
  std::string api_key;
  // Origins whose web pages may call the API (CORS): "scheme://host[:port]" each, or "*" for any;
  // none: no CORS headers, so browsers keep other origins' pages out.
  std::vector<std::string> allowed_origins;
  ServedModel model;
  Limits limits;
  int64_t max_batch_rows = 16;                // most sequences the engine generates at once
  int64_t prefill_chunk = 256;                // most prompt tokens a step runs (0: whole prompts)
  std::optional<tokenizer::ChatFormat> chat;  // none: /v1/chat/completions answers 400
};

// True for 127.0.0.1, ::1 and localhost.
bool is_loopback(const std::string& host);
// Throws unless the host is loopback or there is an API key.
void check_bind(const std::string& host, const std::string& api_key);
// Throws naming an entry that is neither "*" nor an origin ("http://host" or "https://host",
// with an optional port and no path).
void check_allowed_origins(const std::vector<std::string>& origins);

class Server {
 public:
  // Binds (throws naming the address when it cannot, or when the host is not loopback and there
  // is no API key). The model and tokenizer must outlive the server.
  Server(const model::Llama& model, const tokenizer::Tokenizer& tok, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  void run();    // serves until stop()
  void start();  // run() on a thread of its own; returns once it listens
  void stop();
  // Takes no new API request (503) and stops once those taken have finished, streams included
  // (stop() would cut them: the HTTP server ends every stream it is still writing).
  void stop_gracefully();

  Engine& engine() { return *engine_; }
  int64_t in_flight() const { return in_flight_.load(); }

 private:
  void add_routes();
  // CORS: the headers that let an allowed origin's page read the answer; true when the request
  // was a preflight, answered here.
  bool allow_cross_origin(const httplib::Request& req, httplib::Response& res) const;

  const tokenizer::Tokenizer& tok_;
  ServerOptions options_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<httplib::Server> http_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<bool> draining_{false};
  // stop_gracefully() and run() meet through these whichever comes first.
  std::atomic<bool> stop_requested_{false}, entered_run_{false}, ran_{false};
  RequestCounts requests_;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace pollen::serve
