// The Prometheus text exposition format (0.0.4): HELP/TYPE lines, labels, escaping, special
// values, and refused names. tests/fed/server_metrics_test.cpp parses a whole scrape with
// prometheus_client.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "obs/prometheus.h"
#include "obs/seconds_histogram.h"

using namespace pollen;

TEST(Prometheus, FamiliesSamplesAndLabels) {
  obs::PrometheusText p;
  p.gauge("pollen_round", "Rounds done.", 3);
  p.family("pollen_loss", "gauge", "Loss per client.");
  p.sample(4.25, {{"client", "silo-a"}});
  p.sample(0.1, {{"client", "b"}, {"split", "val"}});
  p.counter("pollen_bytes_total", "Bytes.", 1e12);
  EXPECT_EQ(p.text(),
            "# HELP pollen_round Rounds done.\n# TYPE pollen_round gauge\npollen_round 3\n"
            "# HELP pollen_loss Loss per client.\n# TYPE pollen_loss gauge\n"
            "pollen_loss{client=\"silo-a\"} 4.25\npollen_loss{client=\"b\",split=\"val\"} 0.1\n"
            "# HELP pollen_bytes_total Bytes.\n# TYPE pollen_bytes_total counter\n"
            "pollen_bytes_total 1e+12\n");
}

TEST(Prometheus, EscapesAndSpecialValues) {
  obs::PrometheusText p;
  p.family("m", "untyped", "a \\ b\nc \"d\"");
  p.sample(NAN, {{"l", "x\"y\\z\nw"}});
  p.sample(INFINITY);
  p.sample(-INFINITY);
  EXPECT_EQ(p.text(),
            "# HELP m a \\\\ b\\nc \"d\"\n# TYPE m untyped\nm{l=\"x\\\"y\\\\z\\nw\"} NaN\n"
            "m +Inf\nm -Inf\n");
  // Shortest decimal that reads back as the same double.
  EXPECT_EQ(obs::prometheus_value(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(std::stod(obs::prometheus_value(1.0 / 3)), 1.0 / 3);
}

TEST(Prometheus, RefusesInvalidNamesAndTypes) {
  obs::PrometheusText p;
  EXPECT_THROW(p.sample(1), Error);  // no family yet
  EXPECT_THROW(p.gauge("1abc", "h", 1), Error);
  EXPECT_THROW(p.gauge("a-b", "h", 1), Error);
  EXPECT_THROW(p.family("ok", "summary", "h"), Error);
  EXPECT_THROW(p.gauge("rounds_total", "a gauge named as a counter", 1), Error);
  p.gauge("a:b_c", "colons are allowed in metric names", 1);
  EXPECT_THROW(p.sample(1, {{"a:b", "v"}}), Error);  // not in label names
  EXPECT_THROW(p.sample(1, {{"__reserved", "v"}}), Error);
  EXPECT_THROW(p.sample(1, {{"", "v"}}), Error);
}

TEST(Prometheus, HistogramsAreCumulativeBucketsSumAndCount) {
  obs::PrometheusText p;
  p.family("pollen_seconds", "histogram", "Request seconds.");
  // 2 at or under 0.1, 1 in (0.1, 1], none in (1, 10], 1 above 10.
  p.histogram({0.1, 1, 10}, {2, 1, 0, 1}, 12.5, {{"path", "/v1"}});
  EXPECT_EQ(p.text(),
            "# HELP pollen_seconds Request seconds.\n# TYPE pollen_seconds histogram\n"
            "pollen_seconds_bucket{path=\"/v1\",le=\"0.1\"} 2\n"
            "pollen_seconds_bucket{path=\"/v1\",le=\"1\"} 3\n"
            "pollen_seconds_bucket{path=\"/v1\",le=\"10\"} 3\n"
            "pollen_seconds_bucket{path=\"/v1\",le=\"+Inf\"} 4\n"
            "pollen_seconds_sum{path=\"/v1\"} 12.5\npollen_seconds_count{path=\"/v1\"} 4\n");
  EXPECT_THROW(p.sample(1), Error);                                 // a histogram takes histogram()
  EXPECT_THROW(p.histogram({1}, {1}, 1), Error);                    // one count short of +Inf
  EXPECT_THROW(p.histogram({1}, {1, 0}, 1, {{"le", "x"}}), Error);  // le is the buckets'
  p.gauge("after", "h", 1);
  EXPECT_THROW(p.histogram({1}, {1, 0}, 1), Error);  // not a histogram family
}

TEST(SecondsHistogram, EachDurationInTheFirstBucketItDoesNotPass) {
  obs::SecondsHistogram h;
  const auto& b = obs::SecondsHistogram::bounds();
  ASSERT_EQ(h.counts.size(), b.size() + 1);
  h.observe(0.005);   // on a bound: that bucket (Prometheus's le is "at most")
  h.observe(0.0051);  // just over: the next
  h.observe(1.0);
  h.observe(500);  // over every bound: the last
  EXPECT_EQ(h.counts[0], 1);
  EXPECT_EQ(h.counts[1], 1);
  EXPECT_EQ(h.counts[static_cast<size_t>(std::find(b.begin(), b.end(), 1.0) - b.begin())], 1);
  EXPECT_EQ(h.counts.back(), 1);
  EXPECT_DOUBLE_EQ(h.sum, 0.005 + 0.0051 + 1.0 + 500);
}
