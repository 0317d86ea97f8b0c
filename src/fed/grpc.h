#pragma once
// The federation over gRPC: the server's service (every RPC validated, errors returned as gRPC
// statuses and logged, never a crash) and the client's transport. With TLS both sides
// authenticate: the server requires a client certificate signed by the CA, refuses revoked ones
// (the CA-signed CRL of `pollen fed certs revoke`), and takes the certificate's common name as
// the client's identity.
#include <memory>
#include <string>

#include "fed/client.h"
#include "fed/config.h"
#include "fed/coordinator.h"
#include "fed/tokenizer_round.h"

namespace pollen::fed {

class GrpcServer {
 public:
  // Listens on `address` ("host:port"; port 0 picks a free one).
  GrpcServer(Coordinator& coordinator, const std::string& address, const TlsFiles& tls);
  // The federated tokenizer's server (PushCounts, PullTokenizer); training calls are refused.
  GrpcServer(TokenizerRound& round, const std::string& address, const TlsFiles& tls);
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;
  int port() const;
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void start(const std::string& address, const TlsFiles& tls);
};

class GrpcTransport : public Transport {
 public:
  // A call waits up to connect_timeout_s for the server; a pull or push stream that moves nothing
  // for stall_timeout_s is cancelled (a server hung with its connection open).
  GrpcTransport(const std::string& address, const TlsFiles& tls, double connect_timeout_s,
                double stall_timeout_s);
  ~GrpcTransport() override;
  pb::JoinReply join(const pb::JoinRequest& r) override;
  pb::TaskReply task(const pb::TaskRequest& r) override;
  void pull(const pb::PullRequest& r,
            const std::function<void(const pb::TensorStream&)>& on_message) override;
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override;
  pb::SecAggReply secagg(const pb::SecAggRequest& r) override;
  // The federated tokenizer: a silo's count file, then the trained tokenizer.json.
  pb::PushReply push_counts(const std::function<bool(pb::FileStream&)>& next);
  void pull_tokenizer(const pb::TokenizerRequest& r,
                      const std::function<void(const pb::FileStream&)>& on_message);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Development certificates (OpenSSL, EC P-256, SHA-256): in `dir`, ca.pem/ca.key (made once,
// reused after), server.pem/server.key for `server_names` (DNS names or IP addresses), and
// client-<id>.pem/client-<id>.key with common name <id> for each client. An existing server
// certificate is kept (a run that adds clients leaves it be) unless `replace_server`. A client
// that has a certificate already is refused (the old one would stay valid, and --revoke could
// no longer reach it) unless `replace_clients`, which revokes the old one first.
void make_dev_certs(const std::filesystem::path& dir, const std::vector<std::string>& clients,
                    const std::vector<std::string>& server_names, int days,
                    bool replace_server = true, bool replace_clients = false);
// Adds client-<id>.pem's serial to dir/crl.pem (signed by the CA), creating it when needed.
void revoke_client_cert(const std::filesystem::path& dir, const std::string& client);

}  // namespace pollen::fed
