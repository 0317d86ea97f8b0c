// The base layer: config errors, the counter-based RNG, the thread pool, hashing and files.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <functional>
#include <thread>
#include <vector>

#include "base/config.h"
#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/json_depth.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "support/errors.h"

using pollen::testing::error_of;

namespace pollen {
namespace {

TEST(Config, TypedKeysAndDefaults) {
  auto t = ConfigTable::parse("a = 3\nb = 2.5\nc = 'x'\n[sub]\nd = true\n", "run.toml");
  EXPECT_EQ(t.get_int("a", 0), 3);
  EXPECT_EQ(t.get_double("b", 0), 2.5);
  EXPECT_EQ(t.get_double("a", 0), 3.0);  // integers are numbers
  EXPECT_EQ(t.get_string("c", ""), "x");
  EXPECT_EQ(t.get_int("missing", 7), 7);
  auto sub = t.table("sub");
  ASSERT_TRUE(sub);
  EXPECT_TRUE(sub->get_bool("d", false));
  sub->finish();
  t.finish();
}

// TOML's inf and nan are numbers no setting means: refused, naming the key (a data weight of inf
// hung the loader, an lr of inf trained NaN).
TEST(Config, NonFiniteNumbersAreRefused) {
  auto t = ConfigTable::parse("[data]\nweights = [1.0, inf]\n[optimizer]\nlr = nan\n", "run.toml");
  EXPECT_NE(error_of([&] {
              t.table("data")->get_doubles("weights");
            }).find("key 'data.weights': expected finite numbers, found inf"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              t.table("optimizer")->get_double("lr", 0);
            }).find("key 'optimizer.lr': expected a finite number, got nan"),
            std::string::npos);
}

TEST(Config, WrongTypeNamesFileKeyAndExpectedType) {
  auto t = ConfigTable::parse("[model]\nhidden_size = 'big'\n", "run.toml");
  auto m = t.table("model");
  std::string e = error_of([&] { m->get_int("hidden_size", 0); });
  EXPECT_NE(e.find("run.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("model.hidden_size"), std::string::npos) << e;
  EXPECT_NE(e.find("expected an integer, got a string"), std::string::npos) << e;
}

TEST(Config, RangedIntegersNameTheKeyAndTheRangeInsteadOfWrapping) {
  auto t = ConfigTable::parse("threads = 4294967296\nseed = -1\nkeep = 2\n", "run.toml");
  EXPECT_EQ(t.get_int_in("keep", 3, 0, 10), 2);
  EXPECT_EQ(t.get_int_in("missing", 3, 0, 10), 3);
  std::string e = error_of([&] { t.get_int_in("threads", 0, 0, kConfigThreadsMax); });
  EXPECT_NE(e.find("key 'threads'"), std::string::npos) << e;
  EXPECT_NE(e.find("expected an integer from 0 to 65536, got 4294967296"), std::string::npos) << e;
  e = error_of([&] { t.get_int_in("seed", 0, 0, kConfigIntMax); });
  EXPECT_NE(e.find("got -1"), std::string::npos) << e;
}

TEST(Config, UnknownKeysAreErrors) {
  auto t = ConfigTable::parse("hidden_size = 3\nhiden = 4\n", "m.toml");
  t.get_int("hidden_size", 0);
  std::string e = error_of([&] { t.finish(); });
  EXPECT_NE(e.find("unknown key 'hiden'"), std::string::npos) << e;
}

// A required key that is missing beside a near spelling of it names that spelling; a far one
// is not taken for it.
TEST(Config, AMissingKeyNamesANearMisspelling) {
  auto t = ConfigTable::parse("[privacy]\nnoise_multipler = 1.0\nclip = 1.0\n", "run.toml");
  auto p = *t.table("privacy");
  std::string e = error_of([&] { p.require_double("noise_multiplier"); });
  EXPECT_NE(e.find("missing; expected a number ('privacy.noise_multipler' is there: misspelt?)"),
            std::string::npos)
      << e;
  e = error_of([&] { p.require_double("delta"); });
  EXPECT_EQ(e.find("misspelt"), std::string::npos) << e;
}

TEST(Config, SyntaxErrorNamesLine) {
  std::string e = error_of([] { ConfigTable::parse("a = 1\nb = = 2\n", "bad.toml"); });
  EXPECT_NE(e.find("bad.toml', line 2"), std::string::npos) << e;
}

TEST(Philox, KnownAnswerVectors) {
  // Random123's kat_vectors for philox4x32_10.
  EXPECT_EQ(philox4x32(0, 0, 0),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32(~0ULL, ~0ULL, ~0ULL),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32(0x299f31d0a4093822ULL, 0x0370734413198a2eULL, 0x85a308d3243f6a88ULL),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Rng, ResumesFromSeedAndOffset) {
  Rng a(42);
  for (int i = 0; i < 8; ++i) a.next_u32();  // two whole blocks
  Rng b(42, a.offset());
  EXPECT_EQ(a.next_u64(), b.next_u64());
  EXPECT_NE(Rng(1).fork(0).next_u64(), Rng(1).fork(1).next_u64());
}

TEST(Rng, NormalHasUnitMomentsAndBelowIsInRange) {
  Rng r(7);
  double s = 0, s2 = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    double x = r.normal();
    s += x;
    s2 += x * x;
    ASSERT_LT(r.below(10), 10u);
  }
  EXPECT_NEAR(s / n, 0.0, 0.02);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
}

TEST(ThreadPool, ChunksCoverRangeOnceAndErrorsPropagate) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.run_chunks(1000, 7, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_THROW(pool.run_chunks(10, 3,
                               [](int64_t b, int64_t, int) {
                                 if (b > 0) fail("boom");
                               }),
               Error);
}

// Two threads that use the pool at once (a server's engine and an HTTP thread) take turns, and a
// job whose chunks use the pool again runs those inside the chunk: every sum is right and none
// hangs (jobs used to overwrite each other).
TEST(ThreadPool, CallsFromSeveralThreadsTakeTurnsAndNestedCallsRunInline) {
  ThreadPool pool(3);
  const auto sum_to = [&](int64_t n) {
    std::vector<int64_t> part(4, 0);
    pool.run_chunks(n, 4, [&](int64_t b, int64_t e, int c) {
      for (int64_t i = b; i < e; ++i) part[static_cast<size_t>(c)] += i;
    });
    return part[0] + part[1] + part[2] + part[3];
  };
  std::atomic<int> wrong = 0;
  std::vector<std::thread> callers;
  for (int t = 0; t < 3; ++t)
    callers.emplace_back([&, t] {
      for (int k = 0; k < 300; ++k) {
        const int64_t n = 1000 + 17 * t + k;
        if (sum_to(n) != n * (n - 1) / 2) ++wrong;
      }
    });
  for (auto& c : callers) c.join();
  EXPECT_EQ(wrong.load(), 0);
  std::vector<int64_t> inner(6, 0);
  pool.run_chunks(6, 3, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) inner[static_cast<size_t>(i)] = sum_to(100 + i);
  });
  for (int64_t i = 0; i < 6; ++i)
    EXPECT_EQ(inner[static_cast<size_t>(i)], (100 + i) * (99 + i) / 2);
}

// A rank bound to CPUs of its own (Slurm's --cpus-per-task, mpirun's --bind-to core) runs that
// many threads; ranks that share CPUs (free to run anywhere, one taskset or cgroup for all) take
// their share of them.
TEST(ThreadPool, ThreadsPerRankShareOutTheCpusOfOverlappingRanks) {
  const auto cpus = [](int first, int last) {
    CpuMask m;
    for (int c = first; c <= last; ++c) m.set(static_cast<size_t>(c));
    return m;
  };
  // Four ranks of a 16-CPU node, each bound to 4 CPUs of its own.
  const std::vector<CpuMask> bound = {cpus(0, 3), cpus(4, 7), cpus(8, 11), cpus(12, 15)};
  for (const CpuMask& m : bound) EXPECT_EQ(threads_per_rank(m, bound), 4);
  // Four ranks free on all 16; four ranks under one taskset (or cgroup) of 8 CPUs.
  EXPECT_EQ(threads_per_rank(cpus(0, 15), std::vector<CpuMask>(4, cpus(0, 15))), 4);
  EXPECT_EQ(threads_per_rank(cpus(0, 7), std::vector<CpuMask>(4, cpus(0, 7))), 2);
  // Two ranks per socket of 8 CPUs (mpirun's socket binding): each socket shared by two.
  const std::vector<CpuMask> sockets = {cpus(0, 7), cpus(0, 7), cpus(8, 15), cpus(8, 15)};
  EXPECT_EQ(threads_per_rank(cpus(8, 15), sockets), 4);
  // More ranks than CPUs: one thread each.
  EXPECT_EQ(threads_per_rank(cpus(0, 1), std::vector<CpuMask>(3, cpus(0, 1))), 1);
  // This process's mask is what sched_getaffinity says.
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(static_cast<int>(affinity_mask().count()), CPU_COUNT(&set));
  EXPECT_EQ(threads_per_rank(affinity_mask(), {affinity_mask()}), available_cpus());
}

TEST(Hash, Sha256AndXxh64KnownValues) {
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(xxh64("", 0, 0), 0xef46db3751d8e999ULL);
}

TEST(JsonDepth, CountsBracketsOutsideStrings) {
  EXPECT_TRUE(json_depth_within("{\"a\": [[1]]}", 3));
  EXPECT_FALSE(json_depth_within("{\"a\": [[1]]}", 2));
  // Brackets in strings, escaped quotes and backslashes among them, do not count.
  EXPECT_TRUE(json_depth_within(R"([" [[[ \" [[[ \\", "{{{"])", 1));
  EXPECT_FALSE(json_depth_within(R"([" \\", [[]]])", 2));
  const std::string deep = std::string(513, '[') + std::string(513, ']');
  EXPECT_TRUE(json_depth_within(deep, 513));
  EXPECT_NE(error_of([&] {
              check_json_depth(deep, "'x.json'");
            }).find("'x.json': JSON nested more than 512 arrays and objects deep"),
            std::string::npos);
  check_json_depth(std::string(512, '{') + std::string(512, '}'), "'x.json'");
}

// A killed writer's temporary file is removed; a running one's (this process's) and other
// files' are left.
TEST(Files, DeadWritersTemporaryFilesAreRemoved) {
  const auto dir = std::filesystem::temp_directory_path() / "pollen_dead_writers";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  pid_t dead = fork();  // a process that has ended: its pid names no running process
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  const std::string live = std::to_string(::getpid());
  for (const std::string& name :
       std::vector<std::string>{".m.gguf.tmp." + std::to_string(dead), ".m.gguf.tmp." + live,
                                ".other.gguf.tmp." + std::to_string(dead), ".m.gguf.tmp.x"})
    write_file_atomic(dir / name, "partial");
  remove_dead_writers_files(dir / "m.gguf");
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    left.push_back(e.path().filename().string());
  std::ranges::sort(left);
  EXPECT_EQ(left, (std::vector<std::string>{".m.gguf.tmp." + live, ".m.gguf.tmp.x",
                                            ".other.gguf.tmp." + std::to_string(dead)}));
  std::filesystem::remove_all(dir);
}

TEST(Files, AtomicWriteReplacesWholeFile) {
  auto dir = std::filesystem::temp_directory_path() / "pollen_files_test";
  std::filesystem::create_directories(dir);
  auto path = dir / "f.txt";
  write_file_atomic(path, "first");
  write_file_atomic(path, "second version");
  EXPECT_EQ(read_file(path), "second version");
  MappedFile m(path);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.data()), m.size()), "second version");
  for (auto& e : std::filesystem::directory_iterator(dir))
    EXPECT_EQ(e.path().filename(), "f.txt") << "temporary file left behind";
  // A private file is never readable by others, not even as its temporary file.
  write_file_atomic(dir / "key.pem", "secret", 0600);
  EXPECT_EQ(std::filesystem::status(dir / "key.pem").permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  std::filesystem::remove(dir / "key.pem");
  std::string err = error_of([&] { read_file(dir / "missing.txt"); });
  EXPECT_NE(err.find("missing.txt"), std::string::npos);
  // A device (here behind a link, so that an old writer replaces only the link) is written in
  // place, not replaced by a file; a device that takes no bytes is an error.
  std::filesystem::create_symlink("/dev/null", dir / "null");
  write_file_atomic(dir / "null", "into the device");
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "null"));
  std::filesystem::create_symlink("/dev/full", dir / "full");
  EXPECT_NE(error_of([&] { write_file_atomic(dir / "full", "no room"); }).find("full"),
            std::string::npos);
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "full"));
  // A link to a file: the file is replaced whole, the link stays a link.
  write_file_atomic(dir / "v1.json", "old");
  std::filesystem::create_symlink("v1.json", dir / "latest.json");
  write_file_atomic(dir / "latest.json", "new");
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "latest.json"));
  EXPECT_EQ(read_file(dir / "v1.json"), "new");
  // ... also one whose file is not there yet; links in a loop are an error.
  std::filesystem::create_symlink("later.json", dir / "dangling.json");
  write_file_atomic(dir / "dangling.json", "first");
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "dangling.json"));
  EXPECT_EQ(read_file(dir / "later.json"), "first");
  std::filesystem::create_symlink("loop-b", dir / "loop-a");
  std::filesystem::create_symlink("loop-a", dir / "loop-b");
  EXPECT_NE(error_of([&] { write_file_atomic(dir / "loop-a", "x"); }).find("go round in a loop"),
            std::string::npos);
  // A descriptor of this process (as /dev/stdout is) open on a file is written where it stands,
  // after what it wrote before, and the file is not replaced.
  const int fd = ::open((dir / "out.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "before ", 7), 7);
  const auto inode = [&] {
    struct stat st {};
    ::stat((dir / "out.txt").c_str(), &st);
    return st.st_ino;
  };
  const auto first = inode();
  std::filesystem::create_symlink("/proc/self/fd/" + std::to_string(fd), dir / "stdout");
  write_file_atomic(dir / "stdout", "after");
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "stdout"));
  ::close(fd);
  EXPECT_EQ(read_file(dir / "out.txt"), "before after");
  EXPECT_EQ(inode(), first);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pollen
