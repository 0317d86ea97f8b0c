#include "fed/grpc.h"

#include <grpcpp/grpcpp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "base/files.h"
#include "base/log.h"
#include "fed/revocation.h"
#include "fed/stall_watch.h"
#include "fed/tls_check.h"
#include "fed/tls_probe.h"
#include "pollen_fed.grpc.pb.h"

namespace pollen::fed {

namespace {

// Tensor sets travel in chunks of at most 1 MiB; what travels whole in one message is the
// shared second moments (one byte a value of the factored form, about 2/hidden_size of the
// model: 14.5 MB for a Llama of 70B parameters) and token counts (up to ~15 bytes an id of the
// vocabulary), each checked against the model before use. A chunked update is buffered whole
// anyway, so the bound frames messages rather than the memory a client can make the server hold.
constexpr int kMaxMessageBytes = 64 << 20;

// A client pings its server every minute during a call and drops a connection whose ping is not
// answered within 20 s: a server host or network gone mid-stream ends the call, not the client.
constexpr int kClientKeepaliveMs = 60 * 1000;
constexpr int kClientKeepaliveTimeoutMs = 20 * 1000;

// A client makes one call at a time: a few at once allow for one being cancelled while the next
// starts. More from one certificate are refused before anything is read, so that one client
// cannot hold the server's threads, or the messages they read, by the hundred.
constexpr int kMaxOpenCallsPerClient = 4;
// Every call holds a thread of the server: past this many the server answers RESOURCE_EXHAUSTED
// (a client's join and task wait that out as a busy server).
constexpr int kMaxServerThreads = 1024;

std::string read_pem(const std::string& path, const char* what) {
  POLLEN_CHECK(std::filesystem::exists(path), "tls.", what, ": no file '", path, "'");
  return read_file(path);
}

grpc::Status error_status(const std::exception& e, grpc::StatusCode code) {
  return grpc::Status(code, std::string(e.what()).substr(0, 2000));
}

}  // namespace

// ---- server
// ---------------------------------------------------------------------------------------

class FederationService final : public pb::Federation::Service {
 public:
  // Either a training coordinator or a tokenizer round; the other's calls are refused.
  // A pull or push stream that moves nothing for `stall_s` is closed.
  FederationService(Coordinator* c, TokenizerRound* t, bool tls,
                    std::unique_ptr<RevocationList> revoked, double stall_s)
      : c_(c), t_(t), tls_(tls), revoked_(std::move(revoked)), stall_s_(stall_s) {}
  // A tokenizer server's streams stand still for at most this long.
  static constexpr double kTokenizerStallS = 120;

  grpc::Status Join(grpc::ServerContext* ctx, const pb::JoinRequest* r,
                    pb::JoinReply* reply) override {
    return handle(ctx, "join",
                  [&](const std::string& peer) { *reply = training().join(*r, peer); });
  }
  grpc::Status GetTask(grpc::ServerContext* ctx, const pb::TaskRequest* r,
                       pb::TaskReply* reply) override {
    return handle(ctx, "task",
                  [&](const std::string& peer) { *reply = training().task(*r, peer); });
  }
  grpc::Status PullModel(grpc::ServerContext* ctx, const pb::PullRequest* r,
                         grpc::ServerWriter<pb::TensorStream>* writer) override {
    return handle(ctx, "pull", [&](const std::string& peer) {
      StreamGuard guard(*this, ctx, "pull");
      serve_pull(training(), *r, peer, [&](const pb::TensorStream& m) {
        guard.moving();
        guard.check(writer->Write(m), "the client went away");
      });
    });
  }
  grpc::Status PushUpdate(grpc::ServerContext* ctx, grpc::ServerReader<pb::TensorStream>* reader,
                          pb::PushReply* reply) override {
    return handle(ctx, "push", [&](const std::string& peer) {
      StreamGuard guard(*this, ctx, "push");
      *reply = serve_push(training(), peer, [&](pb::TensorStream& m) {
        guard.moving();
        const bool more = reader->Read(&m);
        guard.moved(more);
        return more;
      });
    });
  }
  grpc::Status PushCounts(grpc::ServerContext* ctx, grpc::ServerReader<pb::FileStream>* reader,
                          pb::PushReply* reply) override {
    return handle(ctx, "counts", [&](const std::string& peer) {
      StreamGuard guard(*this, ctx, "counts");
      *reply = serve_counts(tokenizer(), peer, [&](pb::FileStream& m) {
        guard.moving();
        const bool more = reader->Read(&m);
        guard.moved(more);
        return more;
      });
    });
  }
  grpc::Status PullTokenizer(grpc::ServerContext* ctx, const pb::TokenizerRequest* r,
                             grpc::ServerWriter<pb::FileStream>* writer) override {
    return handle(ctx, "tokenizer", [&](const std::string& peer) {
      StreamGuard guard(*this, ctx, "tokenizer");
      serve_tokenizer(tokenizer(), *r, peer, [&](const pb::FileStream& m) {
        guard.moving();
        guard.check(writer->Write(m), "the client went away");
      });
    });
  }
  grpc::Status SecAgg(grpc::ServerContext* ctx, const pb::SecAggRequest* r,
                      pb::SecAggReply* reply) override {
    return handle(ctx, "secure aggregation",
                  [&](const std::string& peer) { *reply = training().secagg(*r, peer); });
  }

 private:
  // A stream that moves nothing for stall_s_ is cancelled, and its read or write fails saying so.
  // Only the waits on the client count (a push that sends nothing holds a thread and is closed):
  // the server's own work between them (the coordinator's checks, its lock, the model a pull
  // sends made first) does not.
  class StreamGuard {
   public:
    StreamGuard(FederationService& s, grpc::ServerContext* ctx, const char* what)
        : s_(s), ctx_(ctx), what_(what) {}
    // A read returned: `more` false ends the stream, as the client's WritesDone, or as a cancel.
    void moved(bool more) {
      if (more) return ticket_->hold();
      const bool cancelled = ticket_->cancelled();
      ticket_.reset();  // the stream is read: the server's answer may take its time
      if (cancelled) stalled();
    }
    void moving() {  // a read or write is about to wait on the client
      if (!ticket_) ticket_ = s_.stalls_.watch(s_.stall_s_, [ctx = ctx_] { ctx->TryCancel(); });
      ticket_->moved();
    }
    void check(bool written, const char* why) {
      if (!written && ticket_->cancelled()) stalled();
      POLLEN_CHECK(written, what_, ": ", why);
      ticket_->hold();
    }

   private:
    [[noreturn]] void stalled() {
      fail(what_, ": nothing moved for ", s_.stall_s_, " s",
           s_.c_ ? " (server.client_timeout_s)" : "", "; the stream is closed");
    }
    FederationService& s_;
    grpc::ServerContext* ctx_;
    const char* what_;
    std::unique_ptr<StallWatch::Ticket> ticket_;
  };

  // The authenticated client: the certificate's common name, after the revocation check.
  std::string peer_id(grpc::ServerContext* ctx) {
    if (!tls_) return "";
    const auto auth = ctx->auth_context();
    const auto cn = auth->FindPropertyValues("x509_common_name");
    const auto pem = auth->FindPropertyValues("x509_pem_cert");
    if (cn.empty() || pem.empty()) throw std::runtime_error("no client certificate");
    const std::string pem_s(pem[0].data(), pem[0].size());
    BIO* b = BIO_new_mem_buf(pem_s.data(), static_cast<int>(pem_s.size()));
    X509* cert = PEM_read_bio_X509(b, nullptr, nullptr, nullptr);
    BIO_free(b);
    if (!cert) throw std::runtime_error("unreadable client certificate");
    const std::string serial = certificate_serial(cert);
    X509_free(cert);
    const std::string id(cn[0].data(), cn[0].size());
    // An empty common name would read as "no TLS" to the coordinator and let the client claim
    // any id: a certificate must name a valid client id.
    if (id.empty()) throw std::runtime_error("the client certificate has no common name");
    check_client_id(id, "the client certificate's common name");
    std::lock_guard lock(serials_mutex_);
    if (revoked_ && revoked_->revoked(serial)) {
      // Only the certificate the client last used: a call still in flight from an old process,
      // with the old certificate, must not drop the client that joined since with a new one.
      const auto last = last_serial_.find(id);
      if (c_ && (last == last_serial_.end() || last->second == serial)) c_->client_revoked(id);
      throw std::runtime_error(
          cat("the certificate of '", id, "' (serial ", serial, ") is revoked"));
    }
    last_serial_[id] = serial;
    return id;
  }

  // A call of a client (its certificate's name; "" without TLS) counted open while it runs.
  class OpenCall {
   public:
    OpenCall(FederationService& s, std::string peer) : s_(s), peer_(std::move(peer)) {}
    OpenCall(const OpenCall&) = delete;
    OpenCall& operator=(const OpenCall&) = delete;
    // False when the client has kMaxOpenCallsPerClient open already (this one is not counted).
    bool admit() {
      if (peer_.empty()) return true;
      std::lock_guard lock(s_.open_mutex_);
      int& open = s_.open_calls_[peer_];
      if (open >= kMaxOpenCallsPerClient) return false;
      ++open;
      counted_ = true;
      return true;
    }
    ~OpenCall() {
      if (!counted_) return;
      std::lock_guard lock(s_.open_mutex_);
      if (--s_.open_calls_[peer_] == 0) s_.open_calls_.erase(peer_);
    }

   private:
    FederationService& s_;
    std::string peer_;
    bool counted_ = false;
  };

  template <typename F>
  grpc::Status handle(grpc::ServerContext* ctx, const char* what, F f) {
    // Who for the log: the address, taken now (a cancelled call's reads "unknown"), and the
    // certificate's name once known.
    std::string who = ctx->peer();
    std::string peer;
    try {
      peer = peer_id(ctx);
    } catch (const std::exception& e) {
      log::warn("fed server: refused ", what, " from ", who, ": ", e.what());
      return error_status(e, grpc::StatusCode::PERMISSION_DENIED);
    }
    if (!peer.empty()) who = cat("client '", peer, "' (", who, ")");
    OpenCall call(*this, peer);
    if (!call.admit()) {
      const std::string why = cat("client '", peer, "' has ", kMaxOpenCallsPerClient,
                                  " calls open at once, the most one client may");
      log::warn("fed server: refused ", what, " from ", who, ": ", why);
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, why);
    }
    try {
      f(peer);
      return grpc::Status::OK;
    } catch (const Error& e) {
      log::warn("fed server: refused ", what, " from ", who, ": ", e.what());
      return error_status(e, grpc::StatusCode::INVALID_ARGUMENT);
    } catch (const std::exception& e) {
      log::error("fed server: ", what, " from ", who, " failed: ", e.what());
      return error_status(e, grpc::StatusCode::INTERNAL);
    }
  }

  Coordinator& training() {
    POLLEN_CHECK(c_ != nullptr, "this server trains a tokenizer, not a model");
    return *c_;
  }
  TokenizerRound& tokenizer() {
    POLLEN_CHECK(t_ != nullptr, "this server trains a model; the tokenizer is agreed already");
    return *t_;
  }

  Coordinator* c_;
  TokenizerRound* t_;
  bool tls_;
  std::unique_ptr<RevocationList> revoked_;  // tls.crl; none: nothing is revoked
  std::mutex serials_mutex_;
  std::map<std::string, std::string> last_serial_;  // client id -> its last accepted certificate
  double stall_s_;
  StallWatch stalls_;
  std::mutex open_mutex_;
  std::map<std::string, int> open_calls_;  // per client certificate, while they run
};

struct GrpcServer::Impl {
  Coordinator* coordinator = nullptr;
  TokenizerRound* tokenizer = nullptr;
  std::unique_ptr<FederationService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

GrpcServer::GrpcServer(Coordinator& c, const std::string& address, const TlsFiles& tls)
    : impl_(std::make_unique<Impl>()) {
  impl_->coordinator = &c;
  start(address, tls);
}

GrpcServer::GrpcServer(TokenizerRound& t, const std::string& address, const TlsFiles& tls)
    : impl_(std::make_unique<Impl>()) {
  impl_->tokenizer = &t;
  start(address, tls);
}

void GrpcServer::start(const std::string& address, const TlsFiles& tls) {
  std::shared_ptr<grpc::ServerCredentials> creds;
  std::unique_ptr<RevocationList> revoked;
  if (tls.enabled()) {
    check_tls_files(tls, TlsRole::server);
    grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    o.pem_root_certs = read_pem(tls.ca, "ca");
    o.pem_key_cert_pairs.push_back({read_pem(tls.key, "key"), read_pem(tls.cert, "cert")});
    creds = grpc::SslServerCredentials(o);
    if (!tls.crl.empty()) revoked = std::make_unique<RevocationList>(tls.crl, o.pem_root_certs);
  } else {
    creds = grpc::InsecureServerCredentials();
  }
  impl_->service = std::make_unique<FederationService>(
      impl_->coordinator, impl_->tokenizer, tls.enabled(), std::move(revoked),
      impl_->coordinator ? impl_->coordinator->config().client_timeout_s
                         : FederationService::kTokenizerStallS);
  grpc::ServerBuilder b;
  // gRPC lets servers share a port by default (SO_REUSEPORT), and the kernel would then hand each
  // of them a share of the clients: a second server on a busy port must fail instead.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // A client whose connection died without closing (a host or network gone) must not hold its
  // streams, and their buffers, for good: the server pings each connection every minute and
  // drops one that does not answer within 20 s.
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  b.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Clients ping every kClientKeepaliveMs during a call; a server that took that for abuse (its
  // default allows one ping in 5 minutes) would drop their connections.
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                       kClientKeepaliveMs / 2);
  b.AddListeningPort(address, creds, &impl_->port);
  b.RegisterService(impl_->service.get());
  b.SetMaxReceiveMessageSize(kMaxMessageBytes);
  b.SetMaxSendMessageSize(kMaxMessageBytes);
  grpc::ResourceQuota quota("pollen-fed-server");
  quota.SetMaxThreads(kMaxServerThreads);
  b.SetResourceQuota(quota);
  impl_->server = b.BuildAndStart();
  POLLEN_CHECK(impl_->server && impl_->port > 0, "fed server: cannot listen on '", address, "'");
  log::info("fed server: listening on ", address, " (port ", impl_->port, ", ",
            tls.enabled() ? "mutual TLS" : "plaintext", ")");
}

GrpcServer::~GrpcServer() {
  shutdown();
}

int GrpcServer::port() const {
  return impl_->port;
}

void GrpcServer::shutdown() {
  if (impl_->server) {
    impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    impl_->server.reset();
  }
}

// ---- client
// ---------------------------------------------------------------------------------------

namespace {

// Where a client looks for its server, for its errors.
struct Endpoint {
  std::string address;
  TlsFiles tls;
  double connect_timeout_s = 60;
  // The server answered a join or task before: failing to reach it now is no sign of a wrong
  // address or TLS setting.
  std::atomic<bool> answered{false};
};

// Whether a call waits for the server to come up (join, task, counts: wait_for_ready and the
// connect timeout), so that failing to reach it means it was never reached.
enum class Waits { for_the_server, no };

// What a failed call says. A call that waits for the server and never reached it (nothing
// listening there, a TLS handshake that failed: gRPC tells the two apart only in the server's
// log) names the address and what to check; another call whose connection failed names the
// address; anything else is the server's refusal with its reason.
std::string failure_text(const grpc::Status& s, const char* what, const Endpoint& e, Waits waits) {
  const auto code = s.error_code();
  const bool unreachable =
      code == grpc::StatusCode::DEADLINE_EXCEEDED || code == grpc::StatusCode::UNAVAILABLE;
  // A call the server cancelled (as it shuts down) is no refusal of what was sent.
  if ((unreachable || code == grpc::StatusCode::CANCELLED) && waits == Waits::no) {
    return cat("the connection to the federation server at ", e.address, " failed during ", what,
               " (", s.error_message(), ")");
  }
  if (unreachable && e.answered) {
    return cat("the federation server at ", e.address, " answered this client before but not ",
               what, " now (", s.error_message(), "; waited up to ", e.connect_timeout_s,
               " s): it stopped since (its run ended, or it was stopped or lost)");
  }
  if (unreachable && e.tls.enabled()) {
    const std::string problem =
        tls_handshake_problem(e.address, e.tls, std::min(e.connect_timeout_s, 10.0));
    if (!problem.empty())
      return cat("could not get through to the federation server at ", e.address, " (", what,
                 ", waited up to ", e.connect_timeout_s, " s): ", problem);
  }
  if (unreachable) {
    return cat(
        "could not reach the federation server at ", e.address, " (", what, ", ", s.error_message(),
        "; waited up to ", e.connect_timeout_s, " s): is it running there, ",
        e.tls.enabled() ? "and does it trust this client's CA, and tls.server_name match its "
                          "certificate? (A TLS handshake tried by hand went through.)"
                        : "and without TLS? A server with [tls] refuses a client without");
  }
  return cat("server refused ", what, " (", static_cast<int>(code), "): ", s.error_message());
}

void check_status(const grpc::Status& s, const char* what, const Endpoint& e, Waits waits) {
  POLLEN_CHECK(s.ok(), failure_text(s, what, e, waits));
}

}  // namespace

struct GrpcTransport::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Federation::Stub> stub;
  Endpoint endpoint;
  double stall_s = 0;
  StallWatch stalls;

  // Watches a stream: cancelled when nothing moves for stall_s (client.busy_timeout_s).
  std::unique_ptr<StallWatch::Ticket> watch(grpc::ClientContext& ctx) {
    return stalls.watch(stall_s, [&ctx] { ctx.TryCancel(); });
  }
  // A stream that failed: its stall if it was cancelled for one, else the connection's failure.
  [[noreturn]] void stream_failed(const StallWatch::Ticket& ticket, const grpc::Status& s,
                                  const char* what) const {
    if (ticket.cancelled()) {
      fail("the federation server at ", endpoint.address, " is connected but moved nothing for ",
           stall_s, " s during ", what, " (client.busy_timeout_s)");
    }
    fail(failure_text(s, what, endpoint, Waits::no));
  }
};

GrpcTransport::GrpcTransport(const std::string& address, const TlsFiles& tls,
                             double connect_timeout_s, double stall_timeout_s)
    : impl_(std::make_unique<Impl>()) {
  impl_->stall_s = stall_timeout_s;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kClientKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kClientKeepaliveTimeoutMs);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (tls.enabled()) {
    check_tls_files(tls, TlsRole::client);
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = read_pem(tls.ca, "ca");
    o.pem_private_key = read_pem(tls.key, "key");
    o.pem_cert_chain = read_pem(tls.cert, "cert");
    creds = grpc::SslCredentials(o);
    if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  impl_->channel = grpc::CreateCustomChannel(address, creds, args);
  impl_->stub = pb::Federation::NewStub(impl_->channel);
  impl_->endpoint.address = address;
  impl_->endpoint.tls = tls;
  impl_->endpoint.connect_timeout_s = connect_timeout_s;
}

GrpcTransport::~GrpcTransport() = default;

namespace {
// Streams the messages `next` fills until it returns false, then waits for the server's reply;
// every message sent counts as the stream moving.
template <class Message>
grpc::Status upload(grpc::ClientWriter<Message>& writer, const std::function<bool(Message&)>& next,
                    StallWatch::Ticket& ticket) {
  Message m;
  while (next(m)) {
    if (!writer.Write(m)) break;  // the server ended the stream; Finish says why
    ticket.moved();
    m.Clear();
  }
  writer.WritesDone();
  return writer.Finish();
}

// Whether a failed call's status is the server's answer (a refusal), not a connection that
// failed or was cancelled, after which what the server did with the call is not known.
bool server_answered(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::UNIMPLEMENTED:
      return true;
    default:
      return false;
  }
}
}  // namespace

namespace {
// Checks a join's or a task's status. Timed out on a connected channel, the server was reached
// but busy: ServerBusy, which the client waits out.
void check_waiting_call(const grpc::Status& s, const char* what, grpc::Channel& channel,
                        const Endpoint& e) {
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
      channel.GetState(false) == GRPC_CHANNEL_READY) {
    throw ServerBusy(cat("the federation server at ", e.address,
                         " is connected but did not answer ", what, " within ", e.connect_timeout_s,
                         " s (busy aggregating or saving)"));
  }
  if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
    throw ServerBusy(cat("the federation server at ", e.address, " has no room for ", what,
                         " now (", s.error_message(), ")"));
  }
  check_status(s, what, e, Waits::for_the_server);
}
}  // namespace

pb::JoinReply GrpcTransport::join(const pb::JoinRequest& r) {
  pb::JoinReply reply;
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);  // the server may not be up yet
  ctx.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(impl_->endpoint.connect_timeout_s * 1000)));
  check_waiting_call(impl_->stub->Join(&ctx, r, &reply), "join", *impl_->channel, impl_->endpoint);
  impl_->endpoint.answered = true;
  return reply;
}

pb::TaskReply GrpcTransport::task(const pb::TaskRequest& r) {
  pb::TaskReply reply;
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);
  ctx.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(impl_->endpoint.connect_timeout_s * 1000)));
  check_waiting_call(impl_->stub->GetTask(&ctx, r, &reply), "task", *impl_->channel,
                     impl_->endpoint);
  impl_->endpoint.answered = true;
  return reply;
}

void GrpcTransport::pull(const pb::PullRequest& r,
                         const std::function<void(const pb::TensorStream&)>& on_message) {
  grpc::ClientContext ctx;
  const auto ticket = impl_->watch(ctx);
  auto reader = impl_->stub->PullModel(&ctx, r);
  pb::TensorStream m;
  try {
    while (reader->Read(&m)) {
      on_message(m);
      ticket->moved();
    }
  } catch (...) {
    ctx.TryCancel();
    reader->Finish();
    throw;
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) impl_->stream_failed(*ticket, s, "pull");
}

pb::SecAggReply GrpcTransport::secagg(const pb::SecAggRequest& r) {
  pb::SecAggReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(impl_->endpoint.connect_timeout_s * 1000)));
  check_status(impl_->stub->SecAgg(&ctx, r, &reply), "secure aggregation", impl_->endpoint,
               Waits::no);
  return reply;
}

pb::PushReply GrpcTransport::push(const std::function<bool(pb::TensorStream&)>& next) {
  grpc::ClientContext ctx;
  const auto ticket = impl_->watch(ctx);
  pb::PushReply reply;
  auto writer = impl_->stub->PushUpdate(&ctx, &reply);
  const grpc::Status s = upload(*writer, next, *ticket);
  if (s.ok()) return reply;
  // Lost with the connection, the update may have arrived all the same: an error, which the
  // client settles by the next task's update_round, not a refusal.
  if (!server_answered(s)) impl_->stream_failed(*ticket, s, "push");
  reply.set_accepted(false);
  reply.set_reason(failure_text(s, "push", impl_->endpoint, Waits::no));
  return reply;
}

pb::PushReply GrpcTransport::push_counts(const std::function<bool(pb::FileStream&)>& next) {
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);  // the server may not be up yet
  ctx.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(impl_->endpoint.connect_timeout_s * 1000)));
  const auto ticket = impl_->watch(ctx);
  pb::PushReply reply;
  auto writer = impl_->stub->PushCounts(&ctx, &reply);
  const grpc::Status s = upload(*writer, next, *ticket);
  if (!s.ok()) {
    reply.set_accepted(false);
    reply.set_reason(ticket->cancelled()
                         ? cat("the federation server at ", impl_->endpoint.address,
                               " moved nothing for ", impl_->stall_s, " s during counts")
                         : failure_text(s, "counts", impl_->endpoint, Waits::for_the_server));
  }
  return reply;
}

void GrpcTransport::pull_tokenizer(const pb::TokenizerRequest& r,
                                   const std::function<void(const pb::FileStream&)>& on_message) {
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);
  const auto ticket = impl_->watch(ctx);
  auto reader = impl_->stub->PullTokenizer(&ctx, r);
  pb::FileStream m;
  try {
    while (reader->Read(&m)) {
      on_message(m);
      ticket->moved();
    }
  } catch (...) {
    ctx.TryCancel();
    reader->Finish();
    throw;
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) impl_->stream_failed(*ticket, s, "tokenizer");
}

}  // namespace pollen::fed
