// The server's observability: /metrics scraped over HTTP during and after a simulated run
// (parsed by prometheus_client, the Prometheus project's Python client), and the per-round
// TensorBoard events read back by tensorboard, both against metrics.jsonl.
#include <gtest/gtest.h>
#include <httplib.h>

#include <cmath>
#include <map>
#include <sstream>

#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/server_metrics.h"
#include "obs/metrics_endpoint.h"
#include "obs/prometheus.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

std::string python_peer() {
  const std::string python = POLLEN_PEERS_PYTHON;
  int status = 0;
  run_capture(python + " -c 'import prometheus_client, tensorboard'", &status);
  return status == 0 ? python : "";
}

// Parses a scrape with prometheus_client; "name{k=v,...} value" per sample, sorted.
std::map<std::string, double> parse_with_peer(const std::string& python, const fs::path& dir,
                                              const std::string& text) {
  write_file_atomic(dir / "scrape.txt", text);
  write_file_atomic(dir / "parse.py", R"PY(
import sys
from prometheus_client.parser import text_string_to_metric_families
for fam in text_string_to_metric_families(open(sys.argv[1]).read()):
    for s in fam.samples:
        labels = ','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))
        print(f'{s.name}{{{labels}}} {s.value!r}')
)PY");
  int status = 0;
  const std::string out = run_capture(
      python + " " + (dir / "parse.py").string() + " " + (dir / "scrape.txt").string(), &status);
  EXPECT_EQ(status, 0) << out;
  std::map<std::string, double> samples;
  std::istringstream in(out);
  std::string key, value;
  while (in >> key >> value) samples[key] = std::stod(value);
  return samples;
}

std::string scrape(int port, const std::string& path, int* status) {
  httplib::Client http("127.0.0.1", port);
  const auto res = http.Get(path);
  EXPECT_TRUE(res) << "no answer from the metrics endpoint";
  if (!res) return "";
  *status = res->status;
  if (res->status == 200) {
    EXPECT_EQ(res->get_header_value("Content-Type"), obs::kPrometheusContentType);
  }
  return res->body;
}

}  // namespace

// A resumed server shows its last round (from metrics.jsonl) until a round closes: not round 0
// ("none yet") beside the rounds it has done.
TEST(FedObservability, AResumedServerShowsItsLastRound) {
  Quiet q;
  const auto dir = temp_dir("observability_resumed");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 2, 2);
  {
    Coordinator server(cfg.server, false);
    LocalTransport transport(server);
    Client a(cfg.clients[0], transport), b(cfg.clients[1], transport);
    a.join();
    b.join();
    ASSERT_TRUE(server.begin_round());
    a.poll_once();
    server.end_round();  // b late: dropped
  }
  const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(m.size(), 1u);
  const Coordinator resumed(cfg.server, true);
  const RoundSummary last = resumed.status().last;
  EXPECT_EQ(last.round, 1);
  EXPECT_TRUE(last.aggregated);
  EXPECT_EQ(last.participants, std::vector<std::string>{"silo-0"});
  EXPECT_EQ(last.dropped, std::vector<std::string>{"silo-1"});
  EXPECT_EQ(last.tokens, m[0]["tokens"].get<int64_t>());
  EXPECT_EQ(last.train_loss, m[0]["train_loss"].get<double>());
  EXPECT_EQ(last.client_train_loss.at("silo-0"),
            m[0]["clients"]["silo-0"]["train_loss"].get<double>());
  const std::string text = prometheus_metrics(resumed.status());
  EXPECT_NE(text.find("\npollen_fed_last_round 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\npollen_fed_last_round_aggregated 1\n"), std::string::npos) << text;
}

TEST(FedObservability, PrometheusScrapeAndTensorBoardMatchTheMetricsFile) {
  const std::string python = python_peer();
  if (python.empty())
    GTEST_SKIP() << "prometheus_client or tensorboard missing (scripts/test-peers)";
  Quiet q;
  const auto dir = temp_dir("observability");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "diloco", 2, 2);
  cfg.server.compression.codec = Codec::int8;
  Coordinator server(cfg.server, false);
  obs::MetricsEndpoint endpoint("127.0.0.1:0", [&] { return prometheus_metrics(server.status()); });
  LocalTransport transport(server);
  Client a(cfg.clients[0], transport), b(cfg.clients[1], transport);
  a.join();
  b.join();

  // During the run: round 1 open, nothing closed yet.
  ASSERT_TRUE(server.begin_round());
  int status = 0;
  auto during = parse_with_peer(python, dir, scrape(endpoint.port(), "/metrics", &status));
  EXPECT_EQ(status, 200);
  EXPECT_EQ(during["pollen_fed_round_open{}"], 1);
  EXPECT_EQ(during["pollen_fed_rounds_done{}"], 0);
  EXPECT_EQ(during["pollen_fed_clients_joined{}"], 2);
  EXPECT_EQ(during["pollen_fed_clients_connected{}"], 2);
  EXPECT_EQ(during["pollen_fed_last_round{}"], 0);
  a.poll_once();  // b is late: dropped from round 1
  server.end_round();
  ASSERT_TRUE(server.begin_round());
  a.poll_once();
  b.poll_once();
  server.end_round();

  // After the run: the last round and the totals, as metrics.jsonl has them.
  const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(m.size(), 2u);
  auto after = parse_with_peer(python, dir, scrape(endpoint.port(), "/metrics", &status));
  EXPECT_EQ(after["pollen_fed_rounds_done{}"], 2);
  EXPECT_EQ(after["pollen_fed_round_open{}"], 0);
  EXPECT_EQ(after["pollen_fed_last_round{}"], 2);
  EXPECT_EQ(after["pollen_fed_last_round_participants{}"], 2);
  EXPECT_EQ(after["pollen_fed_last_round_dropped{}"], 0);
  EXPECT_EQ(after["pollen_fed_dropped_total{}"], 1);
  EXPECT_EQ(after["pollen_fed_last_round_tokens{}"], m[1]["tokens"].get<double>());
  EXPECT_EQ(after["pollen_fed_last_round_bytes_sent{}"], m[1]["bytes_sent"].get<double>());
  EXPECT_EQ(after["pollen_fed_last_round_bytes_received{}"], m[1]["bytes_received"].get<double>());
  EXPECT_EQ(after["pollen_fed_bytes_sent_total{}"],
            m[0]["bytes_sent"].get<double>() + m[1]["bytes_sent"].get<double>());
  EXPECT_EQ(after["pollen_fed_bytes_received_total{}"],
            m[0]["bytes_received"].get<double>() + m[1]["bytes_received"].get<double>());
  EXPECT_EQ(after["pollen_fed_last_round_train_loss{}"], m[1]["train_loss"].get<double>());
  EXPECT_EQ(after["pollen_fed_last_round_eval_loss{}"], m[1]["eval_loss"].get<double>());
  EXPECT_EQ(after["pollen_fed_last_round_wall_seconds{}"], m[1]["wall_s"].get<double>());
  EXPECT_EQ(after["pollen_fed_client_train_loss{client=silo-1}"],
            m[1]["clients"]["silo-1"]["train_loss"].get<double>());
  EXPECT_EQ(after["pollen_fed_client_eval_loss{client=silo-0}"],
            m[1]["clients"]["silo-0"]["eval_loss"].get<double>());
  // Counters get prometheus_client's _total samples; gauges keep their names.
  EXPECT_EQ(after["pollen_fed_tokens_total{}"],
            m[0]["tokens"].get<double>() + m[1]["tokens"].get<double>());
  EXPECT_GT(after["pollen_fed_last_round_bytes_received{}"], 0);
  scrape(endpoint.port(), "/other", &status);
  EXPECT_EQ(status, 404);

  // TensorBoard: one file under server.dir/tensorboard with every round's scalars.
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(cfg.server.dir / "tensorboard")) {
    files.push_back(e.path());
  }
  ASSERT_EQ(files.size(), 1u);
  write_file_atomic(dir / "tb.py", R"PY(
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})
acc.Reload()
for tag in sorted(acc.Tags()['scalars']):
    for e in acc.Scalars(tag):
        print(tag, e.step, repr(e.value))
)PY");
  const std::string out = run_capture(
      python + " " + (dir / "tb.py").string() + " " + (cfg.server.dir / "tensorboard").string(),
      &status);
  ASSERT_EQ(status, 0) << out;
  std::map<std::string, double> tb;
  std::istringstream in(out);
  std::string tag;
  int64_t step = 0;
  double value = 0;
  while (in >> tag >> step >> value) tb[tag + "@" + std::to_string(step)] = value;
  for (int r = 1; r <= 2; ++r) {
    const auto& line = m[static_cast<size_t>(r - 1)];
    const std::string at = "@" + std::to_string(r);
    EXPECT_FLOAT_EQ(tb["fed/train_loss" + at], line["train_loss"].get<float>()) << out;
    EXPECT_FLOAT_EQ(tb["fed/eval_loss" + at], line["eval_loss"].get<float>()) << out;
    EXPECT_EQ(tb["fed/participants" + at], line["participants"].size()) << out;
    EXPECT_EQ(tb["fed/dropped" + at], line["dropped"].size()) << out;
    EXPECT_FLOAT_EQ(tb["fed/bytes_sent" + at], line["bytes_sent"].get<float>()) << out;
    EXPECT_FLOAT_EQ(tb["fed/bytes_received" + at], line["bytes_received"].get<float>()) << out;
    EXPECT_FLOAT_EQ(tb["client/silo-0/train_loss" + at],
                    line["clients"]["silo-0"]["train_loss"].get<float>())
        << out;
  }
  EXPECT_EQ(tb.count("client/silo-1/train_loss@1"), 0u) << "silo-1 was dropped from round 1";
  fs::remove_all(dir);
}

TEST(FedObservability, APrivateRunShowsTheEpsilonItSpent) {
  Quiet q;
  const auto dir = temp_dir("observability-dp");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 1, 2);
  cfg.server.privacy = central_dp(1.0, 0.05);
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  Client a(cfg.clients[0], transport), b(cfg.clients[1], transport);
  a.join();
  b.join();
  EXPECT_NE(prometheus_metrics(server.status()).find("\npollen_fed_private_rounds 0\n"),
            std::string::npos);
  ASSERT_TRUE(server.begin_round());
  a.poll_once();
  b.poll_once();
  server.end_round();
  const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(m.size(), 1u);
  const std::string text = prometheus_metrics(server.status());
  // The gauge as the metrics line has it, to the digits the text format prints.
  const auto at = text.find("\npollen_fed_privacy_epsilon ");
  ASSERT_NE(at, std::string::npos) << text;
  const double shown = std::stod(text.substr(at + 28));
  EXPECT_NEAR(shown, m[0]["privacy"]["epsilon"].get<double>(), 1e-9 * shown);
  EXPECT_NE(text.find("\npollen_fed_private_rounds 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\npollen_fed_privacy_delta 1e-05\n"), std::string::npos) << text;
  // And as Prometheus's own client library reads the scrape.
  if (const std::string python = python_peer(); !python.empty()) {
    auto parsed = parse_with_peer(python, dir, text);
    EXPECT_EQ(parsed["pollen_fed_private_rounds{}"], 1);
    EXPECT_DOUBLE_EQ(parsed["pollen_fed_privacy_epsilon{}"], shown);
    EXPECT_DOUBLE_EQ(parsed["pollen_fed_privacy_delta{}"], 1e-5);
  }
  fs::remove_all(dir);
}

TEST(FedObservability, EndpointRefusesMalformedAddresses) {
  auto render = [] { return std::string(); };
  EXPECT_THROW(obs::MetricsEndpoint("127.0.0.1", render), Error);
  EXPECT_THROW(obs::MetricsEndpoint("127.0.0.1:99999", render), Error);
  EXPECT_THROW(obs::MetricsEndpoint("127.0.0.1:9x", render), Error);
}

TEST(FedObservability, AnEndpointStoppedRightAfterItStartedEnds) {
  // Its destructor stops the listening thread; before that thread listened, cpp-httplib's stop()
  // did nothing and the destructor waited for ever.
  for (int i = 0; i < 20; ++i) obs::MetricsEndpoint("127.0.0.1:0", [] { return std::string(); });
}

TEST(FedObservability, EndpointRefusesAPortAnotherHolds) {
  // A second endpoint on a busy port must not take a share of the first one's scrapes.
  obs::MetricsEndpoint first("127.0.0.1:0", [] { return std::string("first\n"); });
  const std::string address = "127.0.0.1:" + std::to_string(first.port());
  try {
    obs::MetricsEndpoint second(address, [] { return std::string("second\n"); });
    ADD_FAILURE() << "a second endpoint listened on " << address;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen there"), std::string::npos) << e.what();
  }
}
