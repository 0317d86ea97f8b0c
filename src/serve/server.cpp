#include "serve/server.h"

#include <openssl/crypto.h>
#include <strings.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>

#include "base/http_server.h"
#include "base/rng.h"
#include "obs/prometheus.h"
#include "serve/connection.h"

namespace pollen::serve {
namespace {

using json = nlohmann::json;

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The method each endpoint takes; null for a path that is none.
const char* endpoint_method(const std::string& path) {
  static const std::pair<const char*, const char*> endpoints[] = {
      {"/health", "GET"},          {"/metrics", "GET"},
      {"/v1/models", "GET"},       {"/tokenizer_info", "GET"},
      {"/tokenize", "POST"},       {"/detokenize", "POST"},
      {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}};
  for (const auto& [p, method] : endpoints)
    if (path == p) return method;
  if (path.starts_with("/v1/models/") && path.size() > 11) return "GET";  // /v1/models/{id}
  return nullptr;
}

// The 401 of a request without the right API key.
// A Content-Length that is not a byte count, which cpp-httplib reads as a huge one ("-1", then a
// 413 after the read timeout) or as none ("abc", then a body said not to be JSON).
std::optional<ApiError> bad_content_length(const httplib::Request& req) {
  if (!req.has_header("Content-Length")) return std::nullopt;
  const std::string value = req.get_header_value("Content-Length");
  if (!value.empty() && value.find_first_not_of("0123456789") == std::string::npos)
    return std::nullopt;  // however long: one past the limit is a 413
  return ApiError(400, "invalid_request_error", "invalid_content_length", "",
                  cat("The request's Content-Length '", value.substr(0, 64),
                      "' is not a byte count: expected digits alone"));
}

// What an error cpp-httplib answered before any handler ran says about the request.
std::string malformed_request_message(int status) {
  if (status == 400)
    return "The request is not valid HTTP/1.1: expected a request line (METHOD /path "
           "HTTP/1.1), then header lines (Name: value) ended by an empty line";
  if (status == 414) return "The request's URL is too long";
  if (status == 431) return "The request's header lines are too long or too many";
  return cat("HTTP status ", status);
}

ApiError unauthorized(const httplib::Request& req) {
  const bool missing = req.get_header_value("Authorization").empty();
  return ApiError(
      401, "invalid_request_error", "invalid_api_key", "",
      missing ? "Missing API key: send 'Authorization: Bearer KEY'" : "Incorrect API key");
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(error_body(e)), "application/json");
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A response id unique across restarts (as OpenAI's are): 128 random bits in hex.
std::string response_id(const char* prefix) {
  char hex[40];
  std::snprintf(hex, sizeof hex, "%016llx%016llx",
                static_cast<unsigned long long>(os_entropy_u64()),
                static_cast<unsigned long long>(os_entropy_u64()));
  return cat(prefix, hex);
}

bool same_key(const std::string& given, const std::string& key) {
  return given.size() == key.size() && CRYPTO_memcmp(given.data(), key.data(), key.size()) == 0;
}

// Whether the request may use the API: no key is set, or it sends "Authorization: Bearer KEY".
bool authorized(const httplib::Request& req, const std::string& api_key) {
  if (api_key.empty()) return true;
  const std::string auth = req.get_header_value("Authorization");
  // The scheme is case-insensitive (RFC 9110): "bearer KEY" too.
  return auth.size() > 7 && strncasecmp(auth.c_str(), "Bearer ", 7) == 0 &&
         same_key(auth.substr(7), api_key);
}

// Keeps a request counted as in flight for as long as it lives (a stream: until it ends).
class Slot {
 public:
  explicit Slot(std::atomic<int64_t>& n) : n_(n) {}
  ~Slot() { --n_; }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

 private:
  std::atomic<int64_t>& n_;
};

// Server-sent events filled by the engine's worker and drained by the HTTP thread.
struct EventQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> events;
  void push(const json& j) {
    {
      std::lock_guard lock(mu);
      events.push_back("data: " + dump(j) + "\n\n");
    }
    cv.notify_all();
  }
};

using Results = std::vector<SequenceResult>;

// When the request this server thread answers was routed (unset: none, or not routed).
thread_local std::chrono::steady_clock::time_point request_start;

// The status a request whose client left before its answer is counted under (nginx's "client
// closed request"): nothing was answered.
constexpr int kClientClosedRequest = 499;

// How long a graceful stop lets the HTTP threads finish writing answers before it shuts down the
// connections they still read from.
constexpr auto kStopGrace = std::chrono::seconds(5);

// Generates a request's sequences and waits for them; a client that leaves meanwhile ends its
// generation, and gets nothing (nullopt: its answer would go nowhere).
std::optional<Results> wait_for_results(Engine& engine, std::vector<Sequence> seqs,
                                        const httplib::Request& req) {
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  std::future<Results> results = engine.submit(std::move(seqs), nullptr, cancelled);
  std::optional<ClientConnection> client;
  while (results.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
    if (!client) client.emplace(req.remote_addr, req.remote_port, req.local_port);
    if (client->gone()) cancelled->store(true);
  }
  Results rs = results.get();
  if (cancelled->load()) return std::nullopt;
  return rs;
}

// Streams `queue`'s events; once the engine is done, `finish` gives the last events ("[DONE]"
// comes after them). A client that goes away sets `cancelled`, which ends its generation
// (cpp-httplib's is_writable() sees a closed connection between writes too).
void stream_events(httplib::Response& res, std::shared_ptr<Slot> slot,
                   std::shared_ptr<EventQueue> queue, std::shared_ptr<std::future<Results>> results,
                   std::shared_ptr<std::atomic<bool>> cancelled,
                   std::function<std::vector<json>(const Results&)> finish) {
  auto finished = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  const auto gone = [cancelled] {
    cancelled->store(true);
    return false;
  };
  res.set_chunked_content_provider(
      "text/event-stream; charset=utf-8",
      [slot, queue, results, finish, finished, gone](size_t, httplib::DataSink& sink) {
        if (!sink.is_writable()) return gone();
        std::deque<std::string> ready;
        {
          std::unique_lock lock(queue->mu);
          queue->cv.wait_for(lock, std::chrono::milliseconds(20),
                             [&] { return !queue->events.empty(); });
          ready.swap(queue->events);
        }
        for (const std::string& e : ready)
          if (!sink.write(e.data(), e.size())) return gone();
        if (*finished) return true;
        if (results->wait_for(std::chrono::seconds(0)) != std::future_status::ready) return true;
        *finished = true;
        std::string tail;
        try {
          const Results r = results->get();
          std::lock_guard lock(queue->mu);  // the worker has pushed its last token by now
          for (const std::string& e : queue->events) tail += e;
          queue->events.clear();
          for (const json& j : finish(r)) tail += "data: " + dump(j) + "\n\n";
        } catch (const std::exception& e) {
          tail += "data: " +
                  dump(error_body(ApiError(500, "server_error", "internal_error", "", e.what()))) +
                  "\n\n";
        }
        tail += "data: [DONE]\n\n";
        if (!sink.write(tail.data(), tail.size())) return gone();
        sink.done();
        return true;
      },
      [cancelled](bool success) {
        if (!success) cancelled->store(true);
      });
}

// OpenAI's usage object.
json usage(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

// A streamed chunk around its choices; with stream_options.include_usage every chunk has a null
// usage but the last (usage_chunk), which has no choices.
std::function<json(json)> chunk_frame(const std::string& id, const std::string& object,
                                      int64_t created, const std::string& model, bool with_usage) {
  return [=](json choices) {
    json j = {{"id", id},
              {"object", object},
              {"created", created},
              {"model", model},
              {"choices", std::move(choices)}};
    if (with_usage) j["usage"] = nullptr;
    return j;
  };
}

// The tokens of a request's prompts and of its generations.
std::pair<int64_t, int64_t> token_counts(const std::vector<std::vector<uint32_t>>& prompts,
                                         const Results& rs) {
  int64_t prompt_tokens = 0, completion_tokens = 0;
  for (const auto& p : prompts) prompt_tokens += static_cast<int64_t>(p.size());
  for (const auto& r : rs) completion_tokens += static_cast<int64_t>(r.generation.tokens.size());
  return {prompt_tokens, completion_tokens};
}

}  // namespace

bool is_loopback(const std::string& host) {
  return host == "127.0.0.1" || host == "::1" || host == "localhost";
}

void check_allowed_origins(const std::vector<std::string>& origins) {
  for (const std::string& o : origins) {
    const size_t host = o.starts_with("http://") ? 7 : o.starts_with("https://") ? 8 : 0;
    POLLEN_CHECK(o == "*" || (host > 0 && o.size() > host &&
                              o.find_first_of("/?#@ ", host) == std::string::npos),
                 "allowed origins: '", o,
                 "' is not an origin: expected scheme://host[:port] (http or https, no path), "
                 "or * for any");
  }
}

void check_bind(const std::string& host, const std::string& api_key) {
  POLLEN_CHECK(is_loopback(host) || !api_key.empty(), "serving on '", host,
               "' (not this machine only) needs an API key: pass --api-key or --api-key-file");
}

Server::Server(const model::Llama& model, const tokenizer::Tokenizer& tok, ServerOptions options)
    : tok_(tok), options_(std::move(options)) {
  check_bind(options_.host, options_.api_key);
  POLLEN_CHECK(options_.model.context > 0, "serve: the model's context must be known");
  // Every id a request may hold (those the tokenizer knows) must have a row in the model.
  POLLEN_CHECK(static_cast<int64_t>(tok.vocab_size()) <= model.config().vocab_size,
               "serve: the tokenizer has ", tok.vocab_size(),
               " ids, more than the model's vocab_size of ", model.config().vocab_size,
               "; pass the model's own tokenizer (--tokenizer)");
  POLLEN_CHECK(options_.limits.max_concurrent >= 1, "serve: max_concurrent must be >= 1");
  engine_ = std::make_unique<Engine>(model, tok, options_.max_batch_rows, options_.prefill_chunk);
  http_ = std::make_unique<httplib::Server>();
  // Threads beyond the limit so that requests over it are answered 429, not left waiting.
  const size_t threads = static_cast<size_t>(options_.limits.max_concurrent) + 4;
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_->set_payload_max_length(options_.limits.max_body_bytes);
  // One request per connection: a request refused before its whole body was read (too large,
  // a multipart form) leaves the rest unread, and on a kept-alive connection those bytes would
  // be read as the next request (smuggled past a proxy). cpp-httplib 0.11 gives a handler no
  // way to close its connection, so none is kept alive.
  http_->set_keep_alive_max_count(1);
  listen_exclusively(*http_);
  add_routes();
  port_ = options_.port == 0
              ? http_->bind_to_any_port(options_.host)
              : (http_->bind_to_port(options_.host, options_.port) ? options_.port : -1);
  POLLEN_CHECK(port_ > 0, "serve: cannot listen on ", options_.host, ":", options_.port,
               " (in use, or not an address of this machine)");
}

Server::~Server() {
  stop();
}

void Server::run() {
  entered_run_ = true;
  if (!stop_requested_) http_->listen_after_bind();
  ran_ = true;
}

void Server::start() {
  // As listen_in_background, through run(): ran_ then says when the HTTP threads have ended.
  thread_ = std::thread([this] { run(); });
  while (!http_->is_running() && !ran_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void Server::stop() {
  http_->stop();
  if (thread_.joinable()) thread_.join();
}

void Server::stop_gracefully() {
  draining_ = true;
  while (in_flight_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // The HTTP server ignores a stop before it listens: a run() not entered yet sees the request
  // and does not listen; one entered is waited for until it listens (or has returned).
  stop_requested_ = true;
  while (entered_run_ && !http_->is_running() && !ran_)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // No new connection from here; the HTTP threads finish writing the answers they hold. Those
  // still reading a request (a body trickled in, an idle kept-alive connection) were taken by
  // nobody: once the grace for answers being written has passed, their connections are shut
  // down, so that no client holds the stop for as long as it keeps sending.
  http_->stop();
  const auto until = std::chrono::steady_clock::now() + kStopGrace;
  while (entered_run_ && !ran_ && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (entered_run_ && !ran_) shut_down_connections(port_);
  stop();
}

bool Server::allow_cross_origin(const httplib::Request& req, httplib::Response& res) const {
  const std::vector<std::string>& allowed = options_.allowed_origins;
  if (allowed.empty()) return false;
  const bool any = std::find(allowed.begin(), allowed.end(), "*") != allowed.end();
  if (!any) res.set_header("Vary", "Origin");  // the answer depends on who asks
  const std::string origin = req.get_header_value("Origin");
  if (origin.empty() ||
      (!any && std::find(allowed.begin(), allowed.end(), origin) == allowed.end()))
    return false;
  res.set_header("Access-Control-Allow-Origin", any ? "*" : origin);
  if (req.method != "OPTIONS" || !req.has_header("Access-Control-Request-Method")) return false;
  // A preflight, answered before any key check: browsers send no credentials with it. The
  // headers asked for are allowed (the OpenAI SDKs send their own beside Authorization).
  res.status = 204;
  res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
  const std::string asked = req.get_header_value("Access-Control-Request-Headers");
  res.set_header("Access-Control-Allow-Headers",
                 asked.empty() ? std::string("Authorization, Content-Type") : asked);
  res.set_header("Access-Control-Max-Age", "600");
  return true;
}

void Server::add_routes() {
  const Limits& limits = options_.limits;
  http_->set_error_handler([limits](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    // A known endpoint asked with another method (httplib answers 404, or 400 for a POST without
    // a body): 405 with the method it takes, rather than an error that blames the URL or body.
    if (const char* allowed = endpoint_method(req.path);
        allowed && req.method != allowed &&
        !(req.method == "HEAD" && std::string_view(allowed) == "GET")) {
      res.set_header("Allow", allowed);
      send_error(
          res, ApiError(405, "invalid_request_error", "method_not_allowed", "",
                        cat(req.method, " is not allowed on ", req.path, ": it takes ", allowed)));
      return;
    }
    if (const auto bad = bad_content_length(req))
      send_error(res, *bad);
    else if (res.status == 413)
      send_error(res, ApiError(413, "invalid_request_error", "request_too_large", "",
                               cat("The request body exceeds this server's limit of ",
                                   limits.max_body_bytes, " bytes")));
    else if (res.status == 404)
      send_error(res, ApiError(404, "invalid_request_error", "unknown_url", "",
                               cat("Unknown URL: ", req.method, " ", req.path)));
    else
      send_error(res, ApiError(res.status, "invalid_request_error", "", "",
                               malformed_request_message(res.status)));
  });

  // Every API call: its key checked, counted against max_concurrent, errors as OpenAI bodies.
  // The key is checked here, once the body has been read, not before routing: a server that
  // answers before reading the body closes its socket with unread bytes, which resets the
  // connection, and the client may lose the 401 to the reset.
  using Handler =
      std::function<void(const httplib::Request&, httplib::Response&, std::shared_ptr<Slot>)>;
  const auto api = [this](Handler handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, options_.api_key)) return send_error(res, unauthorized(req));
      auto slot = std::make_shared<Slot>(in_flight_);
      try {
        const int64_t in_flight = ++in_flight_;
        // After the count: stop_gracefully waits for every request counted before it drains.
        if (draining_)
          throw ApiError(503, "server_error", "shutting_down", "", "This server is shutting down");
        if (in_flight > options_.limits.max_concurrent)
          throw ApiError(429, "rate_limit_error", "too_many_requests", "",
                         cat("This server is busy with ", options_.limits.max_concurrent,
                             " requests; retry later"));
        handler(req, res, slot);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, "server_error", "internal_error", "", e.what()));
      }
    };
  };

  // Every POST: the body read here, at most max_body_bytes however it is framed (cpp-httplib
  // bounds a Content-Length body only, so a chunked one could otherwise grow without end), then
  // the call as api() makes it.
  const auto post = [this, api](Handler handler) {
    return [this, call = api(std::move(handler))](const httplib::Request& req,
                                                  httplib::Response& res,
                                                  const httplib::ContentReader& read) {
      if (req.is_multipart_form_data())
        return send_error(res, ApiError(415, "invalid_request_error", "invalid_json", "",
                                        "The request body must be JSON, not a multipart form"));
      const std::string encoding = req.get_header_value("Content-Encoding");
      if (!encoding.empty() && encoding != "identity")
        return send_error(res, ApiError(415, "invalid_request_error", "unsupported_encoding", "",
                                        cat("The request body's Content-Encoding '", encoding,
                                            "' is not supported; send it uncompressed")));
      if (const auto bad = bad_content_length(req)) return send_error(res, *bad);
      if (!req.has_header("Content-Length") && !req.has_header("Transfer-Encoding"))
        return send_error(res, ApiError(411, "invalid_request_error", "missing_body", "",
                                        "The request has no body: send JSON, with a "
                                        "Content-Length or chunked"));
      const size_t most = options_.limits.max_body_bytes;
      httplib::Request with_body = req;
      bool too_large = false;
      const bool read_whole = read([&](const char* data, size_t n) {
        too_large = with_body.body.size() + n > most;
        if (!too_large) with_body.body.append(data, n);
        return !too_large;
      });
      if (too_large || res.status == 413) {
        return send_error(
            res, ApiError(413, "invalid_request_error", "request_too_large", "",
                          cat("The request body exceeds this server's limit of ", most, " bytes")));
      }
      if (!read_whole)
        return send_error(res, ApiError(400, "invalid_request_error", "invalid_body", "",
                                        "The request body ended before it was complete"));
      call(with_body, res);
    };
  };

  // A draining server answers 503, so that a load balancer stops sending it requests.
  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_) {
      res.status = 503;
      res.set_content(R"({"status":"draining"})", "application/json");
      return;
    }
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  // Prometheus scrapes: behind the API key like the API, but no request slot (a scrape of a busy
  // server must not count as, or be refused for, one of its requests).
  http_->Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, options_.api_key)) return send_error(res, unauthorized(req));
    ServeStatus st;
    st.requests = requests_.answered();
    st.durations = requests_.durations();
    st.in_flight = in_flight_.load();
    st.waiting = engine_->pending();
    st.tokens_generated = engine_->tokens_generated();
    st.largest_batch = engine_->largest_batch();
    st.first_token = engine_->time_to_first_token();
    res.set_content(prometheus_metrics(st), obs::kPrometheusContentType);
  });
  // Counted once answered (a stream once it ended), timed from its routing on this thread; a
  // request refused before routing (a malformed one) is counted without a duration.
  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    request_start = std::chrono::steady_clock::now();
    return allow_cross_origin(req, res) ? httplib::Server::HandlerResponse::Handled
                                        : httplib::Server::HandlerResponse::Unhandled;
  });
  http_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    const bool timed = request_start != std::chrono::steady_clock::time_point{};
    const double seconds =
        timed ? std::chrono::duration<double>(std::chrono::steady_clock::now() - request_start)
                    .count()
              : -1.0;
    request_start = {};
    // One label for every model id: a client cannot grow the metric's label set.
    const std::string label = req.path.starts_with("/v1/models/") ? "/v1/models/{id}" : req.path;
    requests_.count(label, endpoint_method(req.path) != nullptr, res.status, seconds);
  });
  // The one model, as /v1/models lists it and /v1/models/{id} retrieves it; created: when the
  // server started.
  const json served = {{"id", options_.model.name},
                       {"object", "model"},
                       {"created", unix_time()},
                       {"owned_by", "pollen"},
                       {"max_model_len", options_.model.context}};
  http_->Get("/v1/models", api([served](const httplib::Request&, httplib::Response& res, auto) {
               res.set_content(dump({{"object", "list"}, {"data", {served}}}), "application/json");
             }));
  http_->Get("/v1/models/(.+)",
             api([this, served](const httplib::Request& req, httplib::Response& res, auto) {
               check_model({{"model", req.matches[1].str()}}, options_.model);
               res.set_content(dump(served), "application/json");
             }));

  // vLLM's tokenizer endpoints, which lm-evaluation-harness's remote tokenizer uses.
  http_->Get(
      "/tokenizer_info", api([this](const httplib::Request&, httplib::Response& res, auto) {
        const auto text_of = [this](const std::vector<uint32_t>& ids) {
          return ids.empty() ? json(nullptr)
                             : json(tok_.decode(std::vector<uint32_t>{ids.front()}));
        };
        const json info = {
            {"tokenizer_class", "pollen"},
            {"bos_token", options_.model.bos ? text_of({*options_.model.bos}) : json(nullptr)},
            {"eos_token", options_.model.eos ? text_of({*options_.model.eos})
                                             : text_of(options_.model.stop_tokens)},
            {"pad_token", nullptr},
            {"model_max_length", options_.model.context}};
        res.set_content(dump(info), "application/json");
      }));
  http_->Post("/tokenize", post([this](const httplib::Request& req, httplib::Response& res, auto) {
                const json body = parse_body(req.body);
                const TokenizeRequest r = parse_tokenize_request(body);
                tokenizer::EncodeOptions eo;
                eo.special = tokenizer::SpecialPolicy::allow_all();
                eo.add_bos_eos = r.add_special_tokens;
                const auto ids = tok_.encode(r.prompt, eo);
                res.set_content(dump({{"tokens", ids},
                                      {"count", ids.size()},
                                      {"max_model_len", options_.model.context}}),
                                "application/json");
              }));
  http_->Post("/detokenize",
              post([this](const httplib::Request& req, httplib::Response& res, auto) {
                const json body = parse_body(req.body);
                const std::vector<uint32_t> ids = parse_detokenize_request(body, tok_);
                res.set_content(dump({{"prompt", tok_.decode(ids)}}), "application/json");
              }));

  http_->Post(
      "/v1/completions",
      post([this](const httplib::Request& req, httplib::Response& res, std::shared_ptr<Slot> slot) {
        const json body = parse_body(req.body);
        const CompletionRequest r =
            parse_completion_request(body, tok_, options_.model, options_.limits);
        // Choice k is prompt k / n's, sampled from Rng(seed).fork(k).
        const auto n = static_cast<size_t>(r.n);
        std::vector<Sequence> seqs;
        for (size_t k = 0; k < r.prompts.size() * n; ++k)
          seqs.push_back({r.prompts[k / n], r.sampling, Rng(r.sampling.seed).fork(k),
                          r.echo && r.logprobs.has_value(), r.logprobs.value_or(0)});
        const std::string id = response_id("cmpl-");
        const int64_t created = unix_time();
        const std::string name = options_.model.name;
        const bool with_usage = r.include_usage;
        const auto head = chunk_frame(id, "text_completion", created, name, with_usage);
        const auto chunk = [=](size_t index, const std::string& text, json finish) {
          return head({{{"index", index},
                        {"text", text},
                        {"logprobs", nullptr},
                        {"finish_reason", finish}}});
        };
        if (r.stream) {
          auto queue = std::make_shared<EventQueue>();
          auto streams = std::make_shared<std::vector<TextStream>>(
              seqs.size(), TextStream(tok_, r.sampling.stop_strings));
          auto cancelled = std::make_shared<std::atomic<bool>>(false);
          auto results = std::make_shared<std::future<Results>>(engine_->submit(
              std::move(seqs),
              [queue, streams, chunk](size_t s, uint32_t token) {
                const std::string delta = (*streams)[s].on_token(token);
                if (!delta.empty()) queue->push(chunk(s, delta, nullptr));
              },
              cancelled));
          stream_events(res, slot, queue, results, cancelled,
                        [streams, chunk, head, with_usage, prompts = r.prompts](const Results& rs) {
                          std::vector<json> last;
                          for (size_t s = 0; s < rs.size(); ++s)
                            last.push_back(chunk(s, (*streams)[s].finish(rs[s].generation.text),
                                                 rs[s].generation.finish_reason));
                          if (with_usage) {
                            const auto [p, c] = token_counts(prompts, rs);
                            last.push_back(head(json::array()));
                            last.back()["usage"] = usage(p, c);
                          }
                          return last;
                        });
          return;
        }
        const std::optional<Results> answered = wait_for_results(*engine_, std::move(seqs), req);
        if (!answered) {
          res.status = kClientClosedRequest;
          return;
        }
        const Results& rs = *answered;
        json choices = json::array();
        for (size_t k = 0; k < rs.size(); ++k) {
          const model::Generation& g = rs[k].generation;
          choices.push_back(
              {{"index", k},
               {"text", (r.echo ? r.prompt_texts[k / n] : std::string()) + g.text},
               {"logprobs", r.logprobs ? completion_logprobs(tok_, r.prompts[k / n], rs[k], r.echo)
                                       : json(nullptr)},
               {"finish_reason", g.finish_reason}});
        }
        const auto [prompt_tokens, completion_tokens] = token_counts(r.prompts, rs);
        const json out = {{"id", id},           {"object", "text_completion"},
                          {"created", created}, {"model", name},
                          {"choices", choices}, {"usage", usage(prompt_tokens, completion_tokens)}};
        res.set_content(dump(out), "application/json");
      }));

  http_->Post(
      "/v1/chat/completions",
      post([this](const httplib::Request& req, httplib::Response& res, std::shared_ptr<Slot> slot) {
        const json body = parse_body(req.body);
        ChatRequest r = parse_chat_request(body, options_.model, options_.limits);
        if (!options_.chat)
          throw ApiError(400, "invalid_request_error", "no_chat_template", "messages",
                         "This model has no chat template; start the server with --chat-template");
        tokenizer::EncodeOptions eo;
        eo.special = tokenizer::SpecialPolicy::allow_all();
        const std::vector<uint32_t> prompt =
            tok_.encode(tokenizer::render_chat(*options_.chat, r.messages, true), eo);
        // Without a budget from the client the reply may run to the end of the context, as
        // OpenAI's does (up to --max-tokens).
        const int64_t room = options_.model.context - static_cast<int64_t>(prompt.size());
        if (!r.budget_given)
          r.sampling.max_tokens = std::min(r.sampling.max_tokens, std::max<int64_t>(room, 0));
        check_prompt_length(prompt.size(), r.sampling.max_tokens, options_.model, options_.limits,
                            "messages", 1, r.max_tokens_asked);
        // Choice j is sampled from Rng(seed).fork(j).
        std::vector<Sequence> seqs;
        for (int64_t j = 0; j < r.n; ++j)
          seqs.push_back({prompt, r.sampling, Rng(r.sampling.seed).fork(static_cast<uint64_t>(j)),
                          false, r.logprobs.value_or(0)});
        const std::string id = response_id("chatcmpl-");
        const int64_t created = unix_time();
        const std::string name = options_.model.name;
        if (r.stream) {
          const bool with_usage = r.include_usage;
          const auto head = chunk_frame(id, "chat.completion.chunk", created, name, with_usage);
          const auto chunk = [=](size_t index, json delta, json finish) {
            return head({{{"index", index}, {"delta", delta}, {"finish_reason", finish}}});
          };
          auto queue = std::make_shared<EventQueue>();
          for (size_t j = 0; j < seqs.size(); ++j)
            queue->push(chunk(j, {{"role", "assistant"}, {"content", ""}}, nullptr));
          auto streams = std::make_shared<std::vector<TextStream>>(
              seqs.size(), TextStream(tok_, r.sampling.stop_strings));
          auto cancelled = std::make_shared<std::atomic<bool>>(false);
          auto results = std::make_shared<std::future<Results>>(engine_->submit(
              std::move(seqs),
              [queue, streams, chunk](size_t j, uint32_t token) {
                const std::string delta = (*streams)[j].on_token(token);
                if (!delta.empty()) queue->push(chunk(j, {{"content", delta}}, nullptr));
              },
              cancelled));
          stream_events(
              res, slot, queue, results, cancelled,
              [streams, chunk, head, with_usage, prompt](const Results& rs) {
                std::vector<json> last;
                for (size_t j = 0; j < rs.size(); ++j) {
                  const std::string rest = (*streams)[j].finish(rs[j].generation.text);
                  if (!rest.empty()) last.push_back(chunk(j, {{"content", rest}}, nullptr));
                  last.push_back(chunk(j, json::object(), rs[j].generation.finish_reason));
                }
                if (with_usage) {
                  const auto [p, c] = token_counts({prompt}, rs);
                  last.push_back(head(json::array()));
                  last.back()["usage"] = usage(p, c);
                }
                return last;
              });
          return;
        }
        const std::optional<Results> answered = wait_for_results(*engine_, std::move(seqs), req);
        if (!answered) {
          res.status = kClientClosedRequest;
          return;
        }
        const Results& rs = *answered;
        json choices = json::array();
        for (size_t j = 0; j < rs.size(); ++j) {
          const model::Generation& g = rs[j].generation;
          choices.push_back({{"index", j},
                             {"message", {{"role", "assistant"}, {"content", g.text}}},
                             {"logprobs", r.logprobs ? chat_logprobs(tok_, rs[j]) : json(nullptr)},
                             {"finish_reason", g.finish_reason}});
        }
        const auto [n_prompt, n_gen] = token_counts({prompt}, rs);
        const json out = {{"id", id},           {"object", "chat.completion"},
                          {"created", created}, {"model", name},
                          {"choices", choices}, {"usage", usage(n_prompt, n_gen)}};
        res.set_content(dump(out), "application/json");
      }));
}

}  // namespace pollen::serve
