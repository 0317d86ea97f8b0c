#pragma once
// The federated tokenizer over the wire: before training, each silo counts the pre-tokens of
// its own text (optionally with noise, tokenizer/trainer.h), sends only the count file, and
// receives the byte-level BPE the server trains on the merged counts of every expected silo.
// No shared filesystem is needed; the server keeps each silo's count file for audit.
//
//   pollen fed tokenizer --config fed-tokenizer.toml       the server (TokenizerRound)
//   pollen fed counts --server HOST:PORT --id silo-a ...   each silo (run_counts_client)
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fed/config.h"
#include "fed/wire.h"

namespace pollen::fed {

constexpr uint64_t kMaxCountFileBytes = uint64_t{1} << 32;  // 4 GiB

struct TokenizerServerConfig {
  std::filesystem::path dir;  // counts/<client>.counts, tokenizer.json
  std::string address = "127.0.0.1:50051";
  bool allow_plaintext = false;      // listen beyond this host without [tls] (check_plaintext)
  std::vector<std::string> clients;  // the silos whose counts the tokenizer is trained on
  double wait_for_clients_s = 3600;  // for every silo's counts
  double serve_s = 600;              // after training, at most this long for every silo to pull
  uint32_t vocab_size = 32000;
  std::vector<std::string> special_tokens;
  // The pre-tokenisation regex every silo's counts must be made with (tokenizer.pattern: a known
  // name or a regex); empty: the first silo's, which the others must then match.
  std::string pattern;
  TlsFiles tls;
};

TokenizerServerConfig load_tokenizer_server_config(const std::filesystem::path& path);

// The server's side, without the transport. Thread-safe.
class TokenizerRound {
 public:
  explicit TokenizerRound(TokenizerServerConfig config);

  // A silo's count file, assembled and checksummed: refused (throws) unless the id is expected,
  // authenticated and new, and the file parses with the same pattern as the others.
  void add_counts(const std::string& client_id, const std::string& peer_id,
                  const std::string& bytes);
  // The trained tokenizer.json, or null while training has not finished.
  std::shared_ptr<const std::string> tokenizer(const std::string& client_id,
                                               const std::string& peer_id);

  // Waits for every silo's counts, trains, writes dir/tokenizer.json and serves it until every
  // silo pulled it (or serve_s passed). Returns the tokenizer's fingerprint.
  std::string run();
  const TokenizerServerConfig& config() const { return config_; }

  // Throws unless `id` is well formed, one of server.clients and the authenticated peer's.
  // Reserves the client's one counts stream until the returned handle is dropped; throws when
  // one is already open, so that a silo holds one stream's buffer at most.
  std::shared_ptr<void> counts_arriving(const std::string& id);
  std::string check_client(const std::string& id, const std::string& peer_id,
                           const char* what) const;

 private:
  // Throws unless `pattern` is the one the counts must be made with (tokenizer.pattern, else the
  // first silo's); call under mutex_.
  void check_pattern(const std::string& pattern, const std::string& id) const;

  TokenizerServerConfig config_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::filesystem::path> counts_;  // by client id
  std::set<std::string> receiving_;  // ids whose counts are being checked (one push at a time)
  std::set<std::string> arriving_;   // ids whose counts stream is open (one at a time)
  std::string pattern_;
  std::shared_ptr<const std::string> tokenizer_json_;
  std::set<std::string> pulled_;
  std::string gave_up_;  // why no tokenizer comes (not every silo's counts in time), told to pulls
  std::set<std::string> told_gave_up_;
};

// The server's handling of the two streams, for the gRPC service; each throws pollen::Error on a
// bad stream.
pb::PushReply serve_counts(TokenizerRound& t, const std::string& peer_id,
                           const std::function<bool(pb::FileStream&)>& read);
void serve_tokenizer(TokenizerRound& t, const pb::TokenizerRequest& r, const std::string& peer_id,
                     const std::function<void(const pb::FileStream&)>& write);

// `pollen fed tokenizer`: serves a TokenizerRound over gRPC until it is done; returns the
// tokenizer's fingerprint.
std::string run_tokenizer_server(const TokenizerServerConfig& config);

struct CountsClientOptions {
  std::string id, server = "127.0.0.1:50051";
  TlsFiles tls;
  double connect_timeout_s = 60;
  std::vector<std::string> inputs;  // text (a line is a document) or JSONL files
  bool jsonl = false;
  std::string field = "text", pattern = "cl100k_base";
  double noise_stddev = 0;
  std::optional<uint64_t> seed;  // of the noise; none: drawn from the OS, kept secret
  uint64_t min_count = 1;
  std::filesystem::path output;  // where the received tokenizer.json goes
  // Where the counts sent are kept, and read from when the file exists (a rerun sends the same
  // noise); empty: output + ".counts"
  std::filesystem::path counts_file;
};

// A silo's side: counts its text, sends the counts, waits for the tokenizer and writes it.
// Returns the tokenizer's fingerprint.
std::string run_counts_client(const CountsClientOptions& options);

}  // namespace pollen::fed
