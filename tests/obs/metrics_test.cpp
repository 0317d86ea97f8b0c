// Metrics sinks: CRC-32C test vectors, TFRecord framing, files reopened at a saved position, and
// TensorBoard's own event reader reading back the scalars we wrote.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <array>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "base/error.h"
#include "base/files.h"
#include "obs/metrics.h"
#include "obs/plot.h"
#include "obs/progress.h"
#include "support/errors.h"
#include "support/process.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("pollen_obs_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

using pollen::testing::run_capture;

}  // namespace

TEST(Crc32c, KnownVectors) {
  // RFC 3720 (iSCSI) appendix B.4 and the usual check value.
  EXPECT_EQ(obs::crc32c("123456789", 9), 0xe3069283u);
  std::array<uint8_t, 32> zeros{}, ones{}, inc{}, dec{};
  ones.fill(0xff);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(obs::crc32c(zeros.data(), 32), 0x8a9136aau);
  EXPECT_EQ(obs::crc32c(ones.data(), 32), 0x62a8ab43u);
  EXPECT_EQ(obs::crc32c(inc.data(), 32), 0x46dd794eu);
  EXPECT_EQ(obs::crc32c(dec.data(), 32), 0x113fdb5cu);
  EXPECT_EQ(obs::crc32c("", 0), 0u);
  // Continuing a CRC over a split buffer equals one pass.
  EXPECT_EQ(obs::crc32c("6789", 4, obs::crc32c("12345", 5)), 0xe3069283u);
}

TEST(TfRecord, Framing) {
  const std::string data = "hello";
  const std::string r = obs::tfrecord(data);
  ASSERT_EQ(r.size(), 8 + 4 + data.size() + 4);
  uint64_t len;
  std::memcpy(&len, r.data(), 8);
  EXPECT_EQ(len, 5u);
  uint32_t len_crc, data_crc;
  std::memcpy(&len_crc, r.data() + 8, 4);
  std::memcpy(&data_crc, r.data() + 17, 4);
  EXPECT_EQ(len_crc, obs::masked_crc32c(r.data(), 8));
  EXPECT_EQ(data_crc, obs::masked_crc32c("hello", 5));
  EXPECT_EQ(r.substr(12, 5), "hello");
  // Masking as TensorFlow defines it.
  const uint32_t c = obs::crc32c("hello", 5);
  EXPECT_EQ(obs::masked_crc32c("hello", 5), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(AppendFile, ResumeCutsTheTail) {
  const fs::path d = temp_dir("append");
  uint64_t saved = 0;
  {
    obs::JsonlWriter w(d / "m.jsonl");
    w.write({{"step", 1}});
    w.write({{"step", 2}});
    w.file().sync();
    saved = w.file().position();
    w.write({{"step", 3}});  // written after the checkpoint: must go
  }
  {
    obs::JsonlWriter w(d / "m.jsonl", saved);
    EXPECT_EQ(w.file().position(), saved);
    w.write({{"step", 3}});
  }
  EXPECT_EQ(read_file(d / "m.jsonl"), "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n");
  EXPECT_THROW(obs::JsonlWriter(d / "m.jsonl", 1000), pollen::Error);
  fs::remove_all(d);
}

// Metrics files that are missing or shorter than their checkpoint recorded do not keep a run from
// resuming: it goes on from the last whole line (or TFRecord), warning, so that nothing new is
// glued to a cut one; an audit file (Shortfall::refuse, the default) still refuses.
TEST(AppendFile, AShortMetricsFileGoesOnWithWhatItHolds) {
  const fs::path d = temp_dir("append_short");
  write_file_atomic(d / "m.jsonl", "{\"step\":1}\n{\"ste");  // cut inside its second line
  {
    obs::JsonlWriter w(d / "m.jsonl", 1000, obs::Shortfall::keep_whole_lines);
    EXPECT_EQ(w.file().position(), 11u);
    w.write({{"step", 2}});
  }
  EXPECT_EQ(read_file(d / "m.jsonl"), "{\"step\":1}\n{\"step\":2}\n");
  fs::remove(d / "m.jsonl");
  {
    obs::JsonlWriter w(d / "m.jsonl", 22, obs::Shortfall::keep_whole_lines);
    EXPECT_EQ(w.file().position(), 0u);
    w.write({{"step", 3}});
  }
  EXPECT_EQ(read_file(d / "m.jsonl"), "{\"step\":3}\n");
  const std::string e = pollen::testing::error_of([&] { obs::JsonlWriter(d / "m.jsonl", 1000); });
  EXPECT_NE(e.find("fewer than the 1000 its checkpoint recorded"), std::string::npos) << e;
  // An event file cut inside its second record keeps its first; the run goes on in a new file.
  fs::path events;
  uint64_t whole = 0;
  {
    auto w = obs::EventFileWriter::create(d, 1);
    events = w.file().path();
    whole = w.file().position();  // the file_version and session start records
    w.add_scalar("loss", 1.0, 1, 1.0);
  }
  fs::resize_file(events, whole + 10);
  auto w = obs::EventFileWriter::resume(events, whole + 1000, 2);
  EXPECT_EQ(fs::file_size(events), whole);
  EXPECT_NE(w.file().path(), events);
  fs::remove_all(d);
}

// TensorBoard reads a folder's event files in name order, and a restart record in a file read
// later drops the steps an earlier-read file holds past it: a resumed run's file must sort last
// whatever the other files' hosts and pids (a wrapped-around pid, another node) or clock.
TEST(TensorBoard, ANewEventFileSortsAfterEveryOther) {
  const fs::path d = temp_dir("tb_order");
  const int64_t later = static_cast<int64_t>(obs::wall_time_now()) + 100;
  write_file_atomic(d / cat("events.out.tfevents.", later, ".zzzz.99999"), "");
  write_file_atomic(d / "events.out.tfevents.notanumber", "");
  const fs::path file = obs::EventFileWriter::create(d, 1).file().path();
  EXPECT_EQ(file.filename().string().rfind(cat("events.out.tfevents.", later + 1, "."), 0), 0u)
      << file;
  fs::remove_all(d);
}

// A file that takes no more bytes (here: past the file-size limit, as on a full disk) is an error
// naming the file at the write that finds it: ignored, the file would silently lose lines while
// the position (saved in checkpoints) still counted them.
TEST(AppendFile, AFileThatTakesNoMoreBytesIsAClearError) {
  const fs::path d = temp_dir("append_full");
  obs::AppendFile f(d / "m.jsonl");
  f.write("{}\n");
  f.flush();
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
  const rlimit tiny{8, before.rlim_max};
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &tiny), 0);
  std::string error;
  try {
    f.write(std::string(100, 'x'));
    f.flush();
  } catch (const Error& e) {
    error = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(error.find(cat("cannot write '", (d / "m.jsonl").string(), "'")), std::string::npos)
      << error;
  EXPECT_NE(error.find(std::strerror(EFBIG)), std::string::npos) << error;
  fs::remove_all(d);
}

// A JSONL record reaches the file whole when it is written, not when stdio's buffer fills: a run
// killed later (during an evaluation, say) leaves whole lines, not one cut at 4 KB.
TEST(JsonlWriter, EachRecordReachesTheFileWhole) {
  const fs::path d = temp_dir("jsonl_whole");
  obs::JsonlWriter w(d / "metrics.jsonl");
  w.write({{"step", 1}, {"tokens", 10}, {"loss", 2.5}});
  EXPECT_EQ(read_file(d / "metrics.jsonl"), "{\"step\":1,\"tokens\":10,\"loss\":2.5}\n");
  fs::remove_all(d);
}

// A metrics file whose last line a crash cut short still plots: the whole records before it.
TEST(Plot, AnUnfinishedLastLineIsLeftOut) {
  const fs::path d = temp_dir("plot_torn");
  write_file_atomic(d / "metrics.jsonl",
                    "{\"tokens\":10,\"loss\":3.0}\n{\"tokens\":20,\"loss\":2.0}\n{\"tokens\":3");
  write_file_atomic(d / "eval.jsonl", "{\"tokens\":20,\"loss\":2.5,\"data\":\"m\"}\n{\"tok");
  const obs::RunCurves r = obs::read_run_curves(d);
  EXPECT_EQ(r.train_loss.y, (std::vector<double>{3.0, 2.0}));
  ASSERT_EQ(r.checkpoint_loss.size(), 1u);
  EXPECT_EQ(r.checkpoint_loss[0].second.y, std::vector<double>{2.5});
  fs::remove_all(d);
}

// A run folder named with a trailing separator (as shells complete it) keeps its name, and ticks
// are whole multiples of their step (not 0 plus rounding).
TEST(Plot, ATrailingSeparatorAndTicksAcrossZero) {
  const fs::path d = temp_dir("plot_ticks");
  write_file_atomic(d / "metrics.jsonl",
                    "{\"tokens\":10,\"loss\":-0.16}\n{\"tokens\":20,\"loss\":0.0}\n");
  const obs::RunCurves r = obs::read_run_curves(fs::path(d.string() + "/"));
  EXPECT_EQ(r.name, d.filename().string());
  // A bare metrics.jsonl, from inside the run folder: named by that folder.
  const fs::path before = fs::current_path();
  fs::current_path(d);
  EXPECT_EQ(obs::read_run_curves("metrics.jsonl").name, d.filename().string());
  fs::current_path(before);
  const std::string svg = obs::plot_svg({r});
  EXPECT_EQ(svg.find("e-1"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">0<"), std::string::npos) << svg;
  fs::remove_all(d);
}

// Runs in folders of one name (silo-a/run, silo-b/run) get legend names of their own.
TEST(Plot, RunsInFoldersOfOneNameAreToldApart) {
  const fs::path d = temp_dir("plot_names");
  std::vector<fs::path> runs;
  for (const char* silo : {"silo-a", "silo-b", "silo-c"}) {
    const fs::path run = d / silo / (std::string(silo) == "silo-c" ? "other" : "run");
    fs::create_directories(run);
    write_file_atomic(run / "metrics.jsonl", "{\"tokens\":10,\"loss\":3.0}\n");
    runs.push_back(run);
  }
  std::vector<obs::RunCurves> curves;
  for (const auto& r : runs) curves.push_back(obs::read_run_curves(r));
  obs::name_runs_apart(curves, runs);
  EXPECT_EQ(curves[0].name, "silo-a/run");
  EXPECT_EQ(curves[1].name, "silo-b/run");
  EXPECT_EQ(curves[2].name, "other");
  fs::remove_all(d);
}

// An evaluation whose loss was not finite (null in eval.jsonl, as JSON has no NaN) is left out of
// the plot, not a reason to refuse the run.
TEST(Plot, AnEvaluationWithoutAFiniteLossIsLeftOut) {
  const fs::path d = temp_dir("plot_null");
  write_file_atomic(d / "metrics.jsonl", "{\"tokens\":10,\"loss\":3.0}\n");
  write_file_atomic(d / "eval.jsonl",
                    "{\"tokens\":10,\"loss\":null,\"data\":\"m\",\"split\":\"validation\"}\n"
                    "{\"tokens\":20,\"loss\":2.5,\"data\":\"m\",\"split\":\"validation\"}\n");
  const obs::RunCurves r = obs::read_run_curves(d);
  ASSERT_EQ(r.checkpoint_loss.size(), 1u);
  EXPECT_EQ(r.checkpoint_loss[0].second.x, std::vector<double>{20});
  // Evaluations of one dataset at two windows are two curves, named by their window.
  write_file_atomic(d / "eval.jsonl",
                    "{\"tokens\":10,\"loss\":2,\"data\":\"m\",\"split\":\"v\",\"seq\":128}\n"
                    "{\"tokens\":10,\"loss\":3,\"data\":\"m\",\"split\":\"v\",\"seq\":64}\n"
                    "{\"tokens\":20,\"loss\":1,\"data\":\"m\",\"split\":\"v\",\"seq\":128}\n");
  const obs::RunCurves two = obs::read_run_curves(d);
  ASSERT_EQ(two.checkpoint_loss.size(), 2u);
  EXPECT_EQ(two.checkpoint_loss[0].first, "m [v] seq 128");
  EXPECT_EQ(two.checkpoint_loss[0].second.y, (std::vector<double>{2, 1}));
  EXPECT_EQ(two.checkpoint_loss[1].first, "m [v] seq 64");
  write_file_atomic(d / "eval.jsonl", "{\"tokens\":10,\"loss\":1,\"data\":\"m\",\"split\":3}\n");
  const std::string e = pollen::testing::error_of([&] { obs::read_run_curves(d); });
  EXPECT_NE(e.find("eval.jsonl' line 1: expected a JSON object"), std::string::npos) << e;
  fs::remove_all(d);
}

// A federated server's metrics.jsonl (one record per round) plots beside a training run's: the
// clients' train loss after each round, the global model's evaluation before it, against the
// tokens trained over the rounds.
TEST(Plot, AFederatedRunsRounds) {
  const fs::path d = temp_dir("plot_fed");
  write_file_atomic(d / "metrics.jsonl",
                    "{\"round\":1,\"tokens\":100,\"train_loss\":5.0,\"eval_loss\":6.0}\n"
                    "{\"round\":2,\"tokens\":120,\"train_loss\":4.0,\"eval_loss\":4.5}\n");
  const obs::RunCurves r = obs::read_run_curves(d);
  EXPECT_EQ(r.train_loss.x, (std::vector<double>{100, 220}));
  EXPECT_EQ(r.train_loss.y, (std::vector<double>{5.0, 4.0}));
  EXPECT_EQ(r.val_loss.x, (std::vector<double>{0, 100}));
  EXPECT_EQ(r.val_loss.y, (std::vector<double>{6.0, 4.5}));
  fs::remove_all(d);
}

TEST(Progress, FormatsDurations) {
  EXPECT_EQ(obs::format_duration(12.4), "12s");
  EXPECT_EQ(obs::format_duration(185), "3m05s");
  EXPECT_EQ(obs::format_duration(3725), "1h02m");
  EXPECT_EQ(obs::format_duration(NAN), "?");
  EXPECT_EQ(obs::format_duration(1e19), "?");  // llround would overflow: it read "-8s"
}

// A bar wider than the terminal would wrap, and \r could no longer redraw it in place: the line
// drops whole fields from the end, keeps the ETA, and is cut only when even that is too wide.
TEST(Progress, LinesFitTheTerminal) {
  const std::string fields = "loss=7.4362 lr=0.0025 grad_norm=0.68 tok/s=9832";
  const std::string full = obs::progress_line("train", 10, 30, fields, "8s", 0);
  EXPECT_EQ(full,
            "train [########................] 10/30 loss=7.4362 lr=0.0025 grad_norm=0.68 "
            "tok/s=9832 eta 8s");
  EXPECT_EQ(obs::progress_line("train", 10, 30, fields, "8s", 200), full);
  EXPECT_EQ(obs::progress_line("train", 10, 30, fields, "8s", 80),
            "train [########................] 10/30 loss=7.4362 lr=0.0025 eta 8s");
  EXPECT_EQ(obs::progress_line("train", 10, 30, fields, "8s", 50),
            "train [########................] 10/30 eta 8s");
  EXPECT_EQ(obs::progress_line("train", 10, 30, fields, "8s", 21), "train [########.....");
  EXPECT_EQ(obs::progress_line("train", 30, 30, "", "0s", 80),
            "train [########################] 30/30 eta 0s");
  // A count past its total, or below 0, draws a full or an empty bar (it threw length_error).
  EXPECT_EQ(obs::progress_line("train", 31, 30, "", "0s", 80),
            "train [########################] 31/30 eta 0s");
  EXPECT_EQ(obs::progress_line("train", -1, 30, "", "?", 80),
            "train [........................] -1/30 eta ?");
}

TEST(TensorBoard, OwnReaderReadsOurScalarsAndText) {
  const std::string python = POLLEN_PEERS_PYTHON;
  int status = 0;
  if (!fs::exists(python)) GTEST_SKIP() << "no peers venv at " << python << " (scripts/test-peers)";
  run_capture(python + " -c 'import tensorboard'", &status);
  if (status != 0) GTEST_SKIP() << "tensorboard is not installed in the peers venv";

  const fs::path d = temp_dir("tb");
  fs::path file, resumed;
  uint64_t saved = 0;
  {
    auto w = obs::EventFileWriter::create(d, 1);
    file = w.file().path();
    for (int step = 1; step <= 3; ++step) {
      w.add_scalar("train/loss", 10.0 / step, step, 1700000000.0 + step);
      w.add_scalar("train/lr", 1e-3 * step, step, 1700000000.0 + step);
    }
    w.file().sync();
    saved = w.file().position();
    w.add_scalar("train/loss", 99.0, 4, 1700000004.0);  // lost to the "crash"
  }
  const std::string uncut = read_file(file);
  {
    auto w = obs::EventFileWriter::resume(file, saved, 4);
    resumed = w.file().path();
    w.add_scalar("train/loss", 2.5, 4, 1700000004.0);
    w.add_scalar("val/loss", 3.25, 4, 1700000004.0);
    w.add_text("samples", "**Once** upon a time", 4, 1700000004.0);
    // Bytes that are not UTF-8 (a tag from a folder name, a sample cut inside a character)
    // become U+FFFD: TensorBoard would drop the rest of the file, or fail to show the text.
    w.add_scalar("eval/caf\xC3/loss", 1.5, 4, 1700000004.0);
    w.add_text("cut", "a euro \xE2\x82", 4, 1700000004.0);
    w.add_scalar("after/bad", 7.0, 4, 1700000004.0);
    w.file().sync();
  }
  // The interrupted run's file is cut back to the checkpoint's position; the resumed run writes a
  // new file that sorts after it (a folder's files are read in the order of their names).
  EXPECT_EQ(fs::file_size(file), saved);
  EXPECT_GT(resumed.filename().string(), file.filename().string());
  // A TensorBoard that read the lost point before the cut still holds it: put it back, and the
  // resumed file's session restart at step 4 must drop it.
  write_file_atomic(file, uncut);
  // tensorboard's record reader checks both CRCs of every record; the accumulator parses the
  // Event protos and turns simple_value summaries into scalars.
  const std::string script = R"PY(
import glob, sys
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
n = [sum(1 for _ in event_file_loader.RawEventFileLoader(f).Load())
     for f in sorted(glob.glob(sys.argv[1] + '/events.out.tfevents.*'))]
acc = EventAccumulator(sys.argv[2], size_guidance={'scalars': 0, 'tensors': 0})
acc.Reload()
print('records', *n)
for tag in sorted(acc.Tags()['scalars']):
    for e in acc.Scalars(tag):
        print(tag, e.step, repr(round(e.value, 6)), int(e.wall_time))
for e in acc.Tensors('samples'):
    print('text', e.step, acc.SummaryMetadata('samples').plugin_data.plugin_name,
          [d.size for d in e.tensor_proto.tensor_shape.dim],
          e.tensor_proto.string_val[0].decode())
print('unicode', *[ascii(t) for t in sorted(acc.Tags()['scalars']) if not t.isascii()],
      ascii(acc.Tensors('cut')[0].tensor_proto.string_val[0].decode()))
)PY";
  write_file_atomic(d / "read.py", script);
  const std::string out = run_capture(
      python + " " + (d / "read.py").string() + " " + d.string() + " " + d.string(), &status);
  ASSERT_EQ(status, 0) << out;
  // file_version, session start, 7 scalars (the lost one too); file_version, restart, 4 scalars,
  // 2 texts
  EXPECT_NE(out.find("records 9 8"), std::string::npos) << out;
  EXPECT_NE(out.find("unicode 'eval/caf\\ufffd/loss' 'a euro \\ufffd'"), std::string::npos) << out;
  EXPECT_NE(out.find("after/bad 4 7.0 1700000004"), std::string::npos) << out;
  EXPECT_NE(out.find("text 4 text [1] **Once** upon a time"), std::string::npos) << out;
  EXPECT_NE(out.find("train/loss 1 10.0 1700000001"), std::string::npos) << out;
  EXPECT_NE(out.find("train/loss 3 3.333333 1700000003"), std::string::npos) << out;
  EXPECT_NE(out.find("train/loss 4 2.5 1700000004"), std::string::npos) << out;
  EXPECT_EQ(out.find("99.0"), std::string::npos) << out;
  EXPECT_NE(out.find("train/lr 2 0.002 1700000002"), std::string::npos) << out;
  EXPECT_NE(out.find("val/loss 4 3.25 1700000004"), std::string::npos) << out;
  fs::remove_all(d);
}
