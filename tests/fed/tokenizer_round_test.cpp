// The federated tokenizer over gRPC: silos send only their pre-token counts, the server trains
// the BPE on their sum, and every silo receives the same tokenizer, equal to one trained on the
// silos' texts together; malformed or unexpected count streams are refused.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "base/hash.h"
#include "fed/fixtures.h"
#include "fed/grpc.h"
#include "fed/tokenizer_round.h"
#include "support/errors.h"
#include "support/file_size_limit.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

fs::path write_text(const fs::path& path, const std::string& word, int lines) {
  std::string text;
  for (int i = 0; i < lines; ++i) text += cat(word, i % 7, " and ", word, "s of line ", i, "\n");
  write_file_atomic(path, text);
  return path;
}

// dir/name: a fed tokenizer config of `clients` (a TOML list) with `tokenizer` as its [tokenizer]
// table's keys.
fs::path server_toml(const fs::path& dir, const std::string& name, const std::string& clients,
                     const std::string& tokenizer) {
  write_file_atomic(dir / name,
                    cat("[server]\ndir = 'x'\nclients = ", clients, "\n[tokenizer]\n", tokenizer));
  return dir / name;
}

// A count stream of raw bytes as a hostile client would send it.
pb::PushReply push_raw(GrpcTransport& t, const std::string& id, const std::string& bytes) {
  int stage = 0;
  return t.push_counts([&](pb::FileStream& m) {
    if (stage == 0) {
      m.mutable_info()->set_client_id(id);
      m.mutable_info()->set_total_bytes(bytes.size());
      m.mutable_info()->set_sha256(sha256_hex(bytes));
    } else if (stage == 1) {
      m.mutable_chunk()->set_offset(0);
      m.mutable_chunk()->set_data(bytes);
    } else {
      return false;
    }
    ++stage;
    return true;
  });
}

}  // namespace

TEST(FederatedTokenizer, SilosSendCountsOverGrpcAndAllReceiveTheSameTokenizer) {
  Quiet q;
  const auto dir = temp_dir("tokenizer_round");
  const auto a = write_text(dir / "a.txt", "apple", 300);
  const auto b = write_text(dir / "b.txt", "banana", 200);
  TokenizerServerConfig sc;
  sc.dir = dir / "server";
  sc.clients = {"silo-a", "silo-b"};
  sc.vocab_size = 300;
  sc.special_tokens = {"<|endoftext|>"};
  sc.wait_for_clients_s = 120;
  sc.serve_s = 60;
  TokenizerRound round(sc);
  GrpcServer server(round, "127.0.0.1:0", {});
  const std::string address = cat("127.0.0.1:", server.port());

  // Hostile or mistaken streams first: each refused, the server goes on.
  {
    GrpcTransport t(address, {}, 5, 60);
    auto r = push_raw(t, "silo-z", "POLLENPC");
    EXPECT_FALSE(r.accepted());
    EXPECT_NE(r.reason().find("not one of server.clients"), std::string::npos) << r.reason();
    r = push_raw(t, "silo-a", "POLLENPC garbage that is no count file");
    EXPECT_FALSE(r.accepted());
    EXPECT_NE(r.reason().find("counts"), std::string::npos) << r.reason();
    r = t.push_counts([stage = 0](pb::FileStream& m) mutable {
      if (stage++ > 0) return false;
      m.mutable_info()->set_client_id("silo-a");
      m.mutable_info()->set_total_bytes(uint64_t{1} << 40);
      m.mutable_info()->set_sha256(std::string(64, '0'));
      return true;
    });
    EXPECT_FALSE(r.accepted());
    EXPECT_NE(r.reason().find("a count file holds"), std::string::npos) << r.reason();
    // A silo holds one counts stream at a time: a second one while the first is open is refused,
    // and the first's end frees the silo to send again.
    std::atomic<bool> release{false};
    std::thread open([&] {
      GrpcTransport first(address, {}, 5, 60);
      first.push_counts([&, stage = 0](pb::FileStream& m) mutable {
        if (stage++ > 0) {
          while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return false;
        }
        m.mutable_info()->set_client_id("silo-a");
        m.mutable_info()->set_total_bytes(100);
        m.mutable_info()->set_sha256(std::string(64, '0'));
        return true;
      });
    });
    std::string second;
    for (int attempt = 0; attempt < 100 && second.find("already sending") == std::string::npos;
         ++attempt) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      second = push_raw(t, "silo-a", "POLLENPC garbage").reason();
    }
    EXPECT_NE(second.find("counts: client 'silo-a' is already sending its counts"),
              std::string::npos)
        << second;
    release = true;
    open.join();
  }

  std::string fingerprint, error;
  std::thread serving([&] {
    try {
      fingerprint = round.run();
    } catch (const Error& e) {
      error = e.what();
    }
  });
  // Each silo is its own process, as deployed: `pollen fed counts`.
  std::vector<pid_t> silos;
  for (int i = 0; i < 2; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string id = i == 0 ? "silo-a" : "silo-b";
      const std::string input = (i == 0 ? a : b).string();
      const std::string output = (dir / cat("received-", i, ".json")).string();
      freopen((dir / cat("silo-", i, ".log")).c_str(), "w", stdout);
      execl(POLLEN_BINARY, POLLEN_BINARY, "fed", "counts", "--server", address.c_str(), "--id",
            id.c_str(), "--input", input.c_str(), "--output", output.c_str(), "--threads", "1",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    silos.push_back(pid);
  }
  for (pid_t pid : silos) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "a silo failed; see " << dir.string() << "/silo-*.log";
  }
  serving.join();
  server.shutdown();
  ASSERT_EQ(error, "");
  std::vector<std::string> received;
  for (int i = 0; i < 2; ++i) {
    const std::string out = read_file(dir / cat("silo-", i, ".log"));
    const auto at = out.find("fingerprint ");
    received.push_back(at == std::string::npos ? out : out.substr(at + 12, fingerprint.size()));
  }

  // The same tokenizer trained on both texts in one place.
  tokenizer::PieceCounts together(tokenizer::pattern_regex("cl100k_base"));
  together.add_file(a, false, "text");
  together.add_file(b, false, "text");
  const auto pooled = tokenizer::train_bpe(
      together, {300, {"<|endoftext|>"}, tokenizer::pattern_regex("cl100k_base")});
  EXPECT_EQ(fingerprint, pooled.fingerprint());
  EXPECT_EQ(received[0], pooled.fingerprint());
  EXPECT_EQ(received[1], pooled.fingerprint());
  EXPECT_EQ(read_file(dir / "received-0.json"), read_file(sc.dir / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(sc.dir / "counts/silo-a.counts"));  // kept for audit
  fs::remove_all(dir);
}

// A silo's counts are taken once: the same bytes again (a retry) are taken as the ones on file,
// other counts are refused (two noisy copies could be averaged), and a restarted server keeps the
// counts it had. The silo keeps what it sent and sends exactly that again on a rerun.
TEST(FederatedTokenizer, CountsAreTakenOnceAndSurviveARestart) {
  Quiet q;
  const auto dir = temp_dir("tokenizer_once");
  const auto a = write_text(dir / "a.txt", "apple", 100);
  auto counted = [&](uint64_t seed) {
    tokenizer::PieceCounts c(tokenizer::pattern_regex("cl100k_base"));
    c.add_file(a, false, "text");
    c.perturb(2.0, seed, 1);
    c.save(dir / "c.counts");
    return read_file(dir / "c.counts");
  };
  const std::string first = counted(1), other = counted(2);
  ASSERT_NE(first, other);
  TokenizerServerConfig sc;
  sc.dir = dir / "server";
  sc.clients = {"silo-a", "silo-b"};
  sc.vocab_size = 300;
  {
    TokenizerRound round(sc);
    {
      // A server whose disk is full refuses the counts, and takes them once it has room again.
      pollen::testing::FileSizeLimit full_disk(first.size() / 2);
      EXPECT_THROW(round.add_counts("silo-a", "", first), std::exception);
    }
    round.add_counts("silo-a", "", first);
    EXPECT_NO_THROW(round.add_counts("silo-a", "", first));
    const std::string e = pollen::testing::error_of([&] { round.add_counts("silo-a", "", other); });
    EXPECT_NE(e.find("'silo-a' already sent other counts"), std::string::npos) << e;
  }
  TokenizerRound restarted(sc);
  EXPECT_NO_THROW(restarted.add_counts("silo-a", "", first));
  const std::string e =
      pollen::testing::error_of([&] { restarted.add_counts("silo-a", "", other); });
  EXPECT_NE(e.find("already sent other counts"), std::string::npos) << e;

  // The silo's side: a rerun sends the counts it kept, noise and all, without counting again.
  CountsClientOptions o;
  o.id = "silo-a";
  o.inputs = {a.string()};
  o.noise_stddev = 2.0;
  o.output = dir / "tok.json";
  o.counts_file = dir / "kept.counts";
  o.server = "127.0.0.1:1";  // nobody: the counts are made and kept before the call fails
  o.connect_timeout_s = 0.2;
  EXPECT_THROW(run_counts_client(o), Error);
  const std::string kept = read_file(o.counts_file);
  fs::remove(a);  // the text is not read again
  EXPECT_THROW(run_counts_client(o), Error);
  EXPECT_EQ(read_file(o.counts_file), kept);
  // Options that would make other counts (less noise, after a first try failed) are refused
  // rather than the kept counts sent as if made with them.
  o.noise_stddev = 0;
  const std::string exact = pollen::testing::error_of([&] { run_counts_client(o); });
  EXPECT_NE(exact.find("kept.counts' holds the counts this silo made with --noise-stddev 2 "
                       "--min-count 1 --input "),
            std::string::npos)
      << exact;
  EXPECT_NE(exact.find("this run asks for --noise-stddev 0 --min-count 1"), std::string::npos)
      << exact;
  EXPECT_EQ(read_file(o.counts_file), kept);
  // So is another pre-tokenisation pattern (one the server asked for, say): the kept file
  // records its own.
  o.noise_stddev = 2.0;
  o.pattern = "gpt2";
  const std::string patterned = pollen::testing::error_of([&] { run_counts_client(o); });
  EXPECT_NE(patterned.find("made with pre-tokenisation pattern"), std::string::npos) << patterned;
  EXPECT_EQ(patterned.find("could not reach"), std::string::npos) << patterned;
  EXPECT_EQ(read_file(o.counts_file), kept);
  o.pattern = "cl100k_base";
  // The same options with the input spelled otherwise and a min count of 0 (which counts as 1)
  // are the same counts: sent again, not refused.
  o.noise_stddev = 2.0;
  o.min_count = 0;
  o.inputs = {(dir / "." / "a.txt").string()};
  const std::string same = pollen::testing::error_of([&] { run_counts_client(o); });
  EXPECT_EQ(same.find("holds the counts this silo made with"), std::string::npos) << same;
  EXPECT_NE(same.find("could not reach the federation server at 127.0.0.1:1"), std::string::npos)
      << same;  // it went on to send them
  // TLS files that cannot serve (a key of another certificate) are named before any counting.
  fs::remove(o.counts_file);
  make_dev_certs(dir / "certs", {"silo-a", "silo-b"}, {"localhost"}, 1);
  o.tls = {(dir / "certs/ca.pem").string(), (dir / "certs/client-silo-a.pem").string(),
           (dir / "certs/client-silo-b.key").string(), "", ""};
  const std::string mismatched = pollen::testing::error_of([&] { run_counts_client(o); });
  EXPECT_NE(mismatched.find("is not the key of"), std::string::npos) << mismatched;
  EXPECT_FALSE(fs::exists(o.counts_file));
  o.tls = {};
  // An output that cannot be written is named before any counting.
  o.output = dir / "no-such-folder" / "tok.json";
  o.counts_file.clear();
  const std::string unwritable = pollen::testing::error_of([&] { run_counts_client(o); });
  EXPECT_NE(unwritable.find("--output"), std::string::npos) << unwritable;
  EXPECT_FALSE(fs::exists(dir / "no-such-folder"));
  fs::remove_all(dir);
}

// A server that gives up waiting for a silo's counts tells the silos waiting for the tokenizer
// why none comes, naming the missing silo, rather than dropping their connection.
TEST(FederatedTokenizer, ASiloWaitingWhenTheServerGivesUpIsToldWhy) {
  Quiet q;
  const auto dir = temp_dir("tokenizer_give_up");
  TokenizerServerConfig sc;
  sc.dir = dir / "server";
  sc.clients = {"silo-a", "silo-b"};
  sc.vocab_size = 300;
  sc.wait_for_clients_s = 1;
  TokenizerRound round(sc);
  GrpcServer server(round, "127.0.0.1:0", {});
  std::string server_error;
  std::thread serving([&] {
    server_error = pollen::testing::error_of([&] { round.run(); });
    server.shutdown();  // as the command ends
  });
  CountsClientOptions o;
  o.id = "silo-a";
  o.inputs = {write_text(dir / "a.txt", "apple", 50).string()};
  o.output = dir / "tok.json";
  o.server = cat("127.0.0.1:", server.port());
  const std::string silo_error = pollen::testing::error_of([&] { run_counts_client(o); });
  serving.join();
  EXPECT_NE(server_error.find("1 of 2 silos sent their counts within 1 s"), std::string::npos)
      << server_error;
  EXPECT_NE(silo_error.find("1 of 2 silos sent their counts within 1 s "
                            "(server.wait_for_clients_s; missing: 'silo-b')"),
            std::string::npos)
      << silo_error;
  EXPECT_FALSE(fs::exists(o.output));
  fs::remove_all(dir);
}

// A restarted server trains again on the counts it kept: the same tokenizer, served again; with
// changed [tokenizer] keys it would serve another than silos may have fetched, so it refuses and
// leaves the first one as it was.
TEST(FederatedTokenizer, ARestartWithOtherTokenizerKeysDoesNotReplaceTheServedTokenizer) {
  Quiet q;
  const auto dir = temp_dir("tokenizer_keys");
  tokenizer::PieceCounts c(tokenizer::pattern_regex("cl100k_base"));
  c.add_file(write_text(dir / "a.txt", "apple", 100), false, "text");
  c.save(dir / "c.counts");
  TokenizerServerConfig sc;
  sc.dir = dir / "server";
  sc.clients = {"silo-a"};
  sc.vocab_size = 300;
  sc.wait_for_clients_s = 0;
  sc.serve_s = 0;
  std::string first;
  {
    TokenizerRound round(sc);
    round.add_counts("silo-a", "", read_file(dir / "c.counts"));
    first = round.run();
  }
  const std::string served = read_file(sc.dir / "tokenizer.json");
  EXPECT_EQ(TokenizerRound(sc).run(), first);
  sc.vocab_size = 290;
  const std::string e = pollen::testing::error_of([&] { TokenizerRound(sc).run(); });
  EXPECT_NE(e.find("tokenizer.json' (fingerprint " + first + "), trained before a restart"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("the [tokenizer] keys changed since"), std::string::npos) << e;
  EXPECT_EQ(read_file(sc.dir / "tokenizer.json"), served);
  fs::remove(sc.dir / "tokenizer.json");
  EXPECT_NE(TokenizerRound(sc).run(), first);
  fs::remove_all(dir);
}

// tokenizer.pattern pins the pre-tokenisation every silo's counts must be made with: without it
// the first silo's decides, and so could choose the regex every other silo then runs on its text.
TEST(FederatedTokenizer, APinnedPatternRefusesCountsMadeWithAnother) {
  Quiet q;
  const auto dir = temp_dir("tokenizer_pattern");
  const auto a = write_text(dir / "a.txt", "apple", 50);
  tokenizer::PieceCounts c(tokenizer::pattern_regex("cl100k_base"));
  c.add_file(a, false, "text");
  c.save(dir / "c.counts");
  TokenizerServerConfig sc = load_tokenizer_server_config(
      server_toml(dir, "pinned.toml", "['silo-a']", "vocab_size = 300\npattern = 'o200k_base'\n"));
  EXPECT_EQ(sc.pattern, tokenizer::pattern_regex("o200k_base"));
  sc.dir = dir / "server";
  TokenizerRound round(sc);
  const std::string e = pollen::testing::error_of(
      [&] { round.add_counts("silo-a", "", read_file(dir / "c.counts")); });
  EXPECT_NE(e.find("pre-tokenised with pattern cl100k_base, the federation's is o200k_base "
                   "(tokenizer.pattern); the silo counts again with pollen fed counts --pattern "
                   "o200k_base"),
            std::string::npos)
      << e;
  sc.pattern = tokenizer::pattern_regex("cl100k_base");
  TokenizerRound same(sc);
  EXPECT_NO_THROW(same.add_counts("silo-a", "", read_file(dir / "c.counts")));
  // An address without a port would have gRPC listen on 443: refused with the config.
  const std::string no_port = pollen::testing::error_of([&] {
    load_tokenizer_server_config(
        server_toml(dir, "noport.toml", "['silo-a']\naddress = '127.0.0.1'", "vocab_size = 300\n"));
  });
  EXPECT_NE(no_port.find("key 'server.address': expected host:port"), std::string::npos) << no_port;
  const fs::path bad_toml =
      server_toml(dir, "bad.toml", "['silo-a']", "vocab_size = 300\npattern = '(unclosed'\n");
  const std::string bad =
      pollen::testing::error_of([&] { load_tokenizer_server_config(bad_toml); });
  EXPECT_NE(bad.find("tokenizer.pattern"), std::string::npos) << bad;
  // The example config reads, and pins fed counts' default pattern.
  const TokenizerServerConfig example =
      load_tokenizer_server_config(fs::path(POLLEN_SOURCE_DIR) / "configs/fed/tokenizer.toml");
  EXPECT_EQ(example.pattern, tokenizer::pattern_regex(CountsClientOptions{}.pattern));
  fs::remove_all(dir);
}

TEST(FederatedTokenizer, ConfigNamesWhatIsWrong) {
  const auto dir = temp_dir("tokenizer_round_config");
  const auto c = load_tokenizer_server_config(server_toml(
      dir, "ok.toml", "['a', 'b']", "vocab_size = 512\nspecial_tokens = ['<|endoftext|>']\n"));
  EXPECT_EQ(c.clients.size(), 2u);
  EXPECT_EQ(c.vocab_size, 512u);
  const fs::path twice = server_toml(dir, "twice.toml", "['a', 'a']", "vocab_size = 512\n");
  try {
    load_tokenizer_server_config(twice);
    ADD_FAILURE() << "a client listed twice was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("clients"), std::string::npos) << e.what();
  }
  // Special tokens are checked when the config is read, not after every silo has sent its counts.
  const fs::path specials = server_toml(
      dir, "specials.toml", "['a']", "vocab_size = 512\nspecial_tokens = ['<|eot|>', '<|eot|>']\n");
  const std::string e = pollen::testing::error_of([&] { load_tokenizer_server_config(specials); });
  EXPECT_NE(e.find("tokenizer.special_tokens"), std::string::npos) << e;
  EXPECT_NE(e.find("'<|eot|>' is listed twice"), std::string::npos) << e;
  // The server's waits are checked too, naming the key and the bound.
  for (const char* key : {"wait_for_clients_s", "serve_s"}) {
    const fs::path wait =
        server_toml(dir, cat(key, ".toml"), cat("['a']\n", key, " = -1"), "vocab_size = 512\n");
    const std::string said = pollen::testing::error_of([&] { load_tokenizer_server_config(wait); });
    EXPECT_NE(said.find(cat("server.", key, "': must be 0 or more")), std::string::npos) << said;
  }
  // A silo's noise must be a finite value >= 0: NaN or -5 sent exact counts.
  for (double noise : {std::nan(""), -5.0}) {
    CountsClientOptions o;
    o.id = "a";
    o.inputs = {(dir / "ok.toml").string()};
    o.noise_stddev = noise;
    o.output = dir / "never.json";
    const std::string said = pollen::testing::error_of([&] { run_counts_client(o); });
    EXPECT_NE(said.find("--noise-stddev"), std::string::npos) << said;
  }
  fs::remove_all(dir);
}
