#include "fed/tokenizer_round.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "base/config.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/rng.h"
#include "fed/grpc.h"
#include "tokenizer/open.h"
#include "tokenizer/pattern.h"
#include "tokenizer/trainer.h"

namespace pollen::fed {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

TokenizerServerConfig load_tokenizer_server_config(const fs::path& path) {
  ConfigTable root = ConfigTable::load(path);
  TokenizerServerConfig c;
  auto s = root.table("server");
  POLLEN_CHECK(s.has_value(), root.where("server"), ": a [server] table is required");
  c.dir = s->require_string("dir");
  c.address = s->get_string("address", c.address);
  check_grpc_address(c.address, s->where("address"));
  c.allow_plaintext = s->get_bool("allow_plaintext", c.allow_plaintext);
  c.clients = s->get_strings("clients");
  c.wait_for_clients_s = s->get_double("wait_for_clients_s", c.wait_for_clients_s);
  c.serve_s = s->get_double("serve_s", c.serve_s);
  check_seconds(*s, "wait_for_clients_s", c.wait_for_clients_s, false);
  check_seconds(*s, "serve_s", c.serve_s, false);
  POLLEN_CHECK(!c.clients.empty(), s->where("clients"), ": at least one client id is required");
  for (const auto& id : c.clients) check_client_id(id, s->where("clients"));
  POLLEN_CHECK(std::set<std::string>(c.clients.begin(), c.clients.end()).size() == c.clients.size(),
               s->where("clients"), ": a client id is listed twice");
  s->finish();
  auto t = root.table("tokenizer");
  POLLEN_CHECK(t.has_value(), root.where("tokenizer"),
               ": a [tokenizer] table with vocab_size is required");
  const int64_t vocab = t->get_int("vocab_size", c.vocab_size);
  POLLEN_CHECK(vocab >= 257 && vocab <= (int64_t{1} << 24), t->where("vocab_size"),
               ": expected 257 to 16777216, got ", vocab);
  c.vocab_size = static_cast<uint32_t>(vocab);
  c.special_tokens = t->get_strings("special_tokens");
  if (t->has("pattern")) {
    try {
      c.pattern = tokenizer::pattern_regex(t->get_string("pattern", ""));
      tokenizer::PieceCounts probe(c.pattern);  // compiles and runs the regex once
      const std::string_view text = "a probe";
      probe.add_documents({&text, 1});
    } catch (const Error& e) {
      fail(t->where("pattern"), ": ", e.what());
    }
  }
  // Checked now, not after every silo has sent its counts.
  tokenizer::check_special_tokens(c.special_tokens, c.vocab_size, t->where("special_tokens"));
  t->finish();
  c.tls = read_tls(root, true);
  check_plaintext(c.address, c.tls, c.allow_plaintext, root.where("server.address"));
  root.finish();
  return c;
}

namespace {

// Parses a silo's count file (magic, layout, piece order, checksum) and checks that its counts,
// summed over `silos` silos at most, can be trained on; returns its pattern.
std::string checked_counts(const fs::path& file, const std::string& id, size_t silos) {
  const std::string pattern = tokenizer::PieceCounts::file_pattern(file);
  tokenizer::PieceCounts check(pattern);
  check.merge_file(file);
  // Bounded per silo so that the sum over every silo's counts trains: a file whose counts would
  // overflow training is refused now, not after every silo has sent its own.
  const uint64_t share = static_cast<uint64_t>(INT64_MAX) / silos;
  POLLEN_CHECK(check.pair_bound() <= share, "counts of '", id, "': counts too large (their ",
               "pairs could reach ", check.pair_bound(), ", over ", share, " per silo)");
  log::info("fed tokenizer: counts of '", id, "': ", check.distinct(), " distinct pieces of ",
            check.bytes_read(), " bytes");
  return pattern;
}

}  // namespace

void TokenizerRound::check_pattern(const std::string& pattern, const std::string& id) const {
  POLLEN_CHECK(pattern_.empty() || pattern == pattern_, "counts of '", id,
               "': pre-tokenised with pattern ", tokenizer::describe_pattern(pattern),
               ", the federation's is ", tokenizer::describe_pattern(pattern_), " (",
               config_.pattern.empty() ? "that of the silos' first counts" : "tokenizer.pattern",
               "); the silo counts again with pollen fed counts --pattern ",
               tokenizer::recognise_pattern(pattern_) ? tokenizer::describe_pattern(pattern_)
                                                      : std::string("and the federation's regex"),
               " once it deleted the counts it kept");
}

TokenizerRound::TokenizerRound(TokenizerServerConfig config)
    : config_(std::move(config)), pattern_(config_.pattern) {
  fs::create_directories(config_.dir / "counts");
  // A restarted server keeps the counts it had taken: no silo is asked to send again (which,
  // with fresh noise, would let the two noisy copies be averaged).
  for (const std::string& id : config_.clients) {
    const fs::path file = config_.dir / "counts" / (id + ".counts");
    if (!fs::exists(file)) continue;
    const std::string pattern = checked_counts(file, id, config_.clients.size());
    check_pattern(pattern, id);
    pattern_ = pattern;
    counts_[id] = file;
    log::info("fed tokenizer: counts of '", id, "' kept from before the restart (", file.string(),
              ")");
  }
}

std::string TokenizerRound::check_client(const std::string& id, const std::string& peer_id,
                                         const char* what) const {
  check_client_id(id, what);
  POLLEN_CHECK(peer_id.empty() || peer_id == id, what, ": client id '", id,
               "' does not match its certificate's common name '", peer_id, "'");
  POLLEN_CHECK(
      std::find(config_.clients.begin(), config_.clients.end(), id) != config_.clients.end(), what,
      ": client '", id, "' is not one of server.clients");
  return id;
}

std::shared_ptr<void> TokenizerRound::counts_arriving(const std::string& id) {
  std::lock_guard lock(mutex_);
  POLLEN_CHECK(arriving_.insert(id).second, "counts: client '", id,
               "' is already sending its counts");
  return std::shared_ptr<void>(nullptr, [this, id](void*) {
    std::lock_guard released(mutex_);
    arriving_.erase(id);
  });
}

void TokenizerRound::add_counts(const std::string& client_id, const std::string& peer_id,
                                const std::string& bytes) {
  const std::string id = check_client(client_id, peer_id, "counts");
  {
    // Reserved before the file is written, so that two pushes of one silo never share it. The
    // same counts again (a silo that retried) are taken as the ones on file; other counts are
    // refused, so that no silo's counts are merged twice or averaged over two noisy copies.
    std::lock_guard lock(mutex_);
    if (!gave_up_.empty()) fail(gave_up_);  // counts come too late to be trained on
    const auto held = counts_.find(id);
    if (held != counts_.end() && read_file(held->second) == bytes) return;
    POLLEN_CHECK(held == counts_.end() && !receiving_.count(id), "counts: client '", id,
                 "' already sent other counts");
    receiving_.insert(id);
  }
  const fs::path file = config_.dir / "counts" / (id + ".counts");
  const fs::path tmp = config_.dir / "counts" / (id + ".counts.received");
  try {
    write_file_atomic(tmp, bytes);
    const std::string pattern = checked_counts(tmp, id, config_.clients.size());
    std::lock_guard lock(mutex_);
    check_pattern(pattern, id);
    pattern_ = pattern;
    fs::rename(tmp, file);
    counts_[id] = file;
    receiving_.erase(id);
    log::info("fed tokenizer: ", counts_.size(), " of ", config_.clients.size(),
              " silos' counts taken");
  } catch (...) {
    std::error_code ignored;  // the error to report is the one caught
    fs::remove(tmp, ignored);
    std::lock_guard lock(mutex_);
    receiving_.erase(id);  // the silo may send again
    throw;
  }
  changed_.notify_all();
}

std::shared_ptr<const std::string> TokenizerRound::tokenizer(const std::string& client_id,
                                                             const std::string& peer_id) {
  const std::string id = check_client(client_id, peer_id, "tokenizer");
  std::lock_guard lock(mutex_);
  if (!gave_up_.empty()) {
    told_gave_up_.insert(id);
    changed_.notify_all();
    fail(gave_up_);
  }
  if (tokenizer_json_) {
    pulled_.insert(id);
    changed_.notify_all();
  }
  return tokenizer_json_;
}

std::string TokenizerRound::run() {
  const auto wait_until = [&](double seconds, auto done) {
    const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(seconds));
    std::unique_lock lock(mutex_);
    while (!done() && Clock::now() < end) changed_.wait_for(lock, std::chrono::milliseconds(200));
    return done();
  };
  const bool all = wait_until(config_.wait_for_clients_s,
                              [&] { return counts_.size() == config_.clients.size(); });
  if (!all) {
    std::string missing;
    {
      std::lock_guard lock(mutex_);
      for (const std::string& id : config_.clients)
        if (!counts_.contains(id)) missing += cat(missing.empty() ? "" : ", ", "'", id, "'");
      gave_up_ = cat("fed tokenizer: ", counts_.size(), " of ", config_.clients.size(),
                     " silos sent their counts within ", config_.wait_for_clients_s,
                     " s (server.wait_for_clients_s; missing: ", missing,
                     "); no tokenizer is trained (the server keeps the counts it took: run it "
                     "again, and the silos that sent theirs send the same again)");
    }
    changed_.notify_all();
    // The silos waiting for the tokenizer ask every 500 ms: let each hear why none comes.
    wait_until(2, [&] {
      return std::ranges::all_of(counts_,
                                 [&](const auto& c) { return told_gave_up_.contains(c.first); });
    });
    fail(gave_up_);
  }
  tokenizer::PieceCounts merged(pattern_);
  for (const auto& [id, file] : counts_) merged.merge_file(file);  // in client-id order
  const tokenizer::Tokenizer tok =
      tokenizer::train_bpe(merged, {config_.vocab_size, config_.special_tokens, pattern_});
  const fs::path out = config_.dir / "tokenizer.json";
  if (fs::exists(out)) {  // trained before a restart: silos may have fetched it already
    const std::string before = tokenizer::open_tokenizer(out, "").fingerprint();
    POLLEN_CHECK(before == tok.fingerprint(), "fed tokenizer: '", out.string(), "' (fingerprint ",
                 before,
                 "), trained before a restart and perhaps fetched by silos already, is not the "
                 "tokenizer these counts give now (fingerprint ",
                 tok.fingerprint(),
                 "): the [tokenizer] keys changed since; put them back, or remove the file to "
                 "serve the new tokenizer and have every silo that fetched the old one run "
                 "pollen fed counts again");
  }
  tokenizer::save_tokenizer(tok, out);
  log::info("fed tokenizer: trained ", tok.vocab_size(), " tokens on ", merged.bytes_read(),
            " bytes of ", counts_.size(), " silos: fingerprint ", tok.fingerprint());
  {
    std::lock_guard lock(mutex_);
    tokenizer_json_ = std::make_shared<const std::string>(read_file(out));
  }
  changed_.notify_all();
  if (!wait_until(config_.serve_s, [&] { return pulled_.size() == config_.clients.size(); })) {
    log::warn("fed tokenizer: ", pulled_.size(), " of ", config_.clients.size(),
              " silos fetched the tokenizer within ", config_.serve_s, " s");
  }
  return tok.fingerprint();
}

pb::PushReply serve_counts(TokenizerRound& t, const std::string& peer_id,
                           const std::function<bool(pb::FileStream&)>& read) {
  pb::FileStream first;
  POLLEN_CHECK(read(first) && first.has_info(), "counts: the stream must open with file info");
  const pb::FileInfo& info = first.info();
  const std::string what = cat("counts of '", info.client_id().substr(0, kMaxIdBytes), "'");
  POLLEN_CHECK(info.total_bytes() >= 1 && info.total_bytes() <= kMaxCountFileBytes, what, ": ",
               info.total_bytes(), " bytes; a count file holds 1 to ", kMaxCountFileBytes);
  POLLEN_CHECK(info.sha256().size() == 64, what, ": sha256 must be 64 hex digits");
  // Both before any byte is kept.
  const std::string id = t.check_client(info.client_id(), peer_id, "counts");
  const std::shared_ptr<void> arriving = t.counts_arriving(id);
  pb::TensorSetHeader header;
  header.set_total_bytes(info.total_bytes());
  header.set_sha256(info.sha256());
  ChunkAssembler chunks(header, what);
  pb::FileStream m;
  while (read(m)) {
    POLLEN_CHECK(m.has_chunk(), what, ": after the info only chunks may follow");
    chunks.add(m.chunk());
  }
  t.add_counts(info.client_id(), peer_id, chunks.finish());
  pb::PushReply reply;
  reply.set_accepted(true);
  return reply;
}

void serve_tokenizer(TokenizerRound& t, const pb::TokenizerRequest& r, const std::string& peer_id,
                     const std::function<void(const pb::FileStream&)>& write) {
  const auto json = t.tokenizer(r.client_id(), peer_id);
  pb::FileStream m;
  if (!json) {
    m.set_wait_ms(500);
    write(m);
    return;
  }
  auto* info = m.mutable_info();
  info->set_total_bytes(json->size());
  info->set_sha256(sha256_hex(*json));
  write(m);
  for_each_chunk(*json, kMaxChunkBytes, [&](const pb::Chunk& c) {
    *m.mutable_chunk() = c;
    write(m);
  });
}

std::string run_tokenizer_server(const TokenizerServerConfig& config) {
  TokenizerRound round(config);
  GrpcServer server(round, config.address, config.tls);
  const std::string fingerprint = round.run();
  server.shutdown();
  return fingerprint;
}

std::string run_counts_client(const CountsClientOptions& o) {
  check_client_id(o.id, "--id");
  check_grpc_address(o.server, "--server");
  // The TLS files are checked before the counting, which can take long: here, and as the
  // transport checks them (their PEM, key, dates and role), which connects only when it sends.
  const std::pair<const std::string*, const char*> tls_files[] = {
      {&o.tls.ca, "--ca"}, {&o.tls.cert, "--cert"}, {&o.tls.key, "--key"}};
  for (const auto& [path, flag] : tls_files)
    POLLEN_CHECK(path->empty() || fs::exists(*path), flag, ": no file '", *path, "'");
  POLLEN_CHECK(o.tls.ca.empty() == o.tls.cert.empty() && o.tls.ca.empty() == o.tls.key.empty(),
               "--ca, --cert and --key go together (mutual TLS), or none of them");
  // A stream that moves nothing for an hour: a server hung with its connection open.
  GrpcTransport transport(o.server, o.tls, o.connect_timeout_s, 3600);
  // Checked here too: a negative or NaN stddev must not quietly send exact counts.
  POLLEN_CHECK(std::isfinite(o.noise_stddev) && o.noise_stddev >= 0, "--noise-stddev ",
               o.noise_stddev, ": expected a finite value >= 0");
  // The counts sent are kept (counts_file, default beside the output) and sent again as they are
  // when the command is run again: a retry never sends the same text under other noise.
  const fs::path kept =
      o.counts_file.empty() ? fs::path(o.output.string() + ".counts") : o.counts_file;
  check_writable(o.output.string(), "--output");  // before the counting, which can take long
  if (!fs::exists(kept))
    check_writable(kept.string(), o.counts_file.empty() ? "--output" : "--counts-file");
  // What the kept counts were made with, beside them: a rerun asking for other counts (noise added
  // after a first try failed, say) is refused rather than sending the kept ones unnoticed. The
  // inputs count as the files they are, in any order and however their paths are spelled.
  const fs::path made_path = kept.string() + ".made";
  std::string made =
      cat("--noise-stddev ", o.noise_stddev, " --min-count ", std::max<uint64_t>(o.min_count, 1),
          o.jsonl ? cat(" --jsonl --field ", o.field) : std::string());
  std::vector<std::string> inputs;
  for (const auto& input : o.inputs) inputs.push_back(fs::weakly_canonical(input).string());
  std::ranges::sort(inputs);
  for (const auto& input : inputs) made += cat(" --input ", input);
  tokenizer::PieceCounts counts(tokenizer::pattern_regex(o.pattern));
  if (fs::exists(kept)) {
    try {
      counts.merge_file(kept);  // checks the file, and that it was made with this pattern
    } catch (const Error& e) {
      fail(e.what(), " (the counts this silo kept and sends again: delete '", kept.string(),
           "' to count again)");
    }
    if (fs::exists(made_path)) {
      const std::string before = read_file(made_path);
      POLLEN_CHECK(before == made, "'", kept.string(), "' holds the counts this silo made with ",
                   before,
                   ", sent again as they are on a rerun (a retry must not send other "
                   "noise); this run asks for ",
                   made, ": run with the earlier options, or delete '", kept.string(),
                   "' to count again with these (if the earlier counts reached the server, it "
                   "refuses other ones)");
    }
    log::info("fed counts '", o.id, "': sending the counts kept in '", kept.string(),
              "' (delete it to count again)");
  } else {
    for (const auto& input : o.inputs) counts.add_file(input, o.jsonl, o.field);
    if (o.noise_stddev > 0 || o.min_count > 1)
      counts.perturb(o.noise_stddev, o.seed ? *o.seed : os_entropy_u64(), o.min_count);
    write_file_atomic(made_path, made);  // first: kept counts are never without it
    counts.save(kept);                   // the file format of `pollen tokenizer count`, checksummed
  }
  const std::string bytes = read_file(kept);
  log::info("fed counts '", o.id, "': ", counts.distinct(), " distinct pieces of ",
            counts.bytes_read(), " bytes, sending ", bytes.size(), " bytes");

  int stage = 0;
  size_t offset = 0;
  const auto reply = transport.push_counts([&](pb::FileStream& m) {
    if (stage == 0) {
      auto* info = m.mutable_info();
      info->set_client_id(o.id);
      info->set_total_bytes(bytes.size());
      info->set_sha256(sha256_hex(bytes));
      stage = 1;
      return true;
    }
    if (offset >= bytes.size()) return false;
    const size_t n = std::min<size_t>(kMaxChunkBytes, bytes.size() - offset);
    m.mutable_chunk()->set_offset(offset);
    m.mutable_chunk()->set_data(bytes.data() + offset, n);
    offset += n;
    return true;
  });
  POLLEN_CHECK(reply.accepted(), "the counts of '", o.id, "' were not taken: ", reply.reason());

  pb::TokenizerRequest r;
  r.set_client_id(o.id);
  const auto give_up = Clock::now() + std::chrono::hours(24);
  for (;;) {
    std::unique_ptr<ChunkAssembler> chunks;
    int64_t wait_ms = 0;
    transport.pull_tokenizer(r, [&](const pb::FileStream& m) {
      if (!chunks) {
        if (m.has_wait_ms()) {
          wait_ms = std::clamp<int64_t>(m.wait_ms(), 10, 5000);
          return;
        }
        POLLEN_CHECK(m.has_info() && m.info().total_bytes() >= 1 &&
                         m.info().total_bytes() <= kMaxCountFileBytes,
                     "tokenizer: the stream must open with the file's info");
        pb::TensorSetHeader h;
        h.set_total_bytes(m.info().total_bytes());
        h.set_sha256(m.info().sha256());
        chunks = std::make_unique<ChunkAssembler>(h, "tokenizer from the server");
      } else {
        POLLEN_CHECK(m.has_chunk(), "tokenizer: after the info only chunks may follow");
        chunks->add(m.chunk());
      }
    });
    if (chunks) {
      write_file_atomic(o.output, chunks->finish());
      break;
    }
    POLLEN_CHECK(wait_ms > 0 && Clock::now() < give_up, "tokenizer: the server sent nothing");
    std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
  }
  const auto tok = tokenizer::open_tokenizer(o.output, "");  // checks the file
  log::info("fed counts '", o.id, "': received the tokenizer, fingerprint ", tok.fingerprint());
  return tok.fingerprint();
}

}  // namespace pollen::fed
