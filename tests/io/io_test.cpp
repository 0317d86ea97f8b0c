// safetensors round trips and malformed headers; checkpoints written atomically with a checksum
// manifest, verified, skipped when corrupt, and pruned.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/hash.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "io/synced_write.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("pollen_io_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string with_header(const std::string& header, const std::string& payload) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + payload;
}

std::string parse_error(const std::string& bytes) {
  try {
    io::parse_safetensors(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size(), "x.st");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDtype) {
  const fs::path d = temp_dir("st");
  io::NamedTensors in;
  in.emplace_back("w", Tensor::from<float>({2, 3}, {1, 2, 3, 4, 5, -6.5f}));
  in.emplace_back("d", Tensor::from<double>({2}, {1e-300, 3}));
  in.emplace_back("i", Tensor::from<int32_t>({3}, {-1, 0, 7}));
  in.emplace_back("empty", Tensor::zeros({0, 4}, DType::f32));
  in.emplace_back("scalar", Tensor::from<float>({}, {42}));
  const auto stats = io::write_safetensors(d / "a.safetensors", in, {{"step", "7"}});
  EXPECT_EQ(stats.sha256, sha256_file(d / "a.safetensors"));
  EXPECT_EQ(stats.bytes, fs::file_size(d / "a.safetensors"));
  // The data starts 8-byte aligned, as the reference library writes it.
  const std::string raw = read_file(d / "a.safetensors");
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(nlohmann::json::parse(raw.substr(8, n))["w"]["dtype"], "F32");

  const auto out = io::read_safetensors(d / "a.safetensors");
  EXPECT_EQ(out.metadata.at("step"), "7");
  ASSERT_EQ(out.tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out.tensors[i].first, in[i].first);
    EXPECT_EQ(out.tensors[i].second.shape(), in[i].second.shape());
    EXPECT_EQ(out.tensors[i].second.dtype(), in[i].second.dtype());
    EXPECT_EQ(std::memcmp(out.tensors[i].second.raw(), in[i].second.raw(), in[i].second.nbytes()),
              0);
  }
  fs::remove_all(d);
}

TEST(Safetensors, RejectsMalformedHeadersClearly) {
  const std::string f4 = std::string(8, '\0');  // two floats
  EXPECT_NE(parse_error("abc").find("too short"), std::string::npos);
  EXPECT_NE(parse_error(with_header("{", "")).find("not valid JSON"), std::string::npos);
  std::string past_end(8, '\0');
  past_end[1] = 4;  // a header of 1024 bytes in a file of 10
  EXPECT_NE(parse_error(past_end + "{}").find("runs past the end"), std::string::npos);
  EXPECT_NE(parse_error(with_header("[]", "")).find("JSON object"), std::string::npos);
  EXPECT_NE(parse_error(with_header(R"({"a":{"dtype":"Q8","shape":[2],"data_offsets":[0,8]}})", f4))
                .find("dtype 'Q8'"),
            std::string::npos);
  EXPECT_NE(
      parse_error(with_header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f4))
          .find("needs 12"),
      std::string::npos);
  EXPECT_NE(
      parse_error(with_header(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f4))
          .find("fall outside"),
      std::string::npos);
  EXPECT_NE(parse_error(with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                    R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                    f4))
                .find("overlap or hole"),
            std::string::npos);
  EXPECT_NE(
      parse_error(with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f4))
          .find("belong to none"),
      std::string::npos);
  EXPECT_NE(
      parse_error(with_header(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", f4))
          .find("non-negative"),
      std::string::npos);
  EXPECT_NE(parse_error(with_header(R"({"a":{"dtype":"F32","shape":[2]}})", f4))
                .find("tensor 'a': data_offsets missing"),
            std::string::npos);
  EXPECT_NE(
      parse_error(with_header(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", f4))
          .find("end before they begin"),
      std::string::npos);
  // Errors name the file.
  EXPECT_NE(parse_error("abc").find("'x.st'"), std::string::npos);
}

// Entries that alias the same bytes are refused before any tensor is allocated: 10^5 entries
// each claiming the whole 1 MiB payload declare 100 GiB, which reading them one by one before
// the overlap check would try to allocate (and run out of memory doing so).
TEST(Safetensors, RefusesAliasingEntriesBeforeAllocatingThem) {
  constexpr int kEntries = 100'000;
  constexpr uint64_t kPayload = uint64_t{1} << 20;
  std::string header = "{";
  for (int i = 0; i < kEntries; ++i) {
    header += (i ? "," : "") + std::string("\"t") + std::to_string(i) +
              "\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(kPayload) +
              "],\"data_offsets\":[0," + std::to_string(kPayload) + "]}";
  }
  header += "}";
  const std::string file = with_header(header, std::string(kPayload, '\0'));
  try {
    EXPECT_NE(parse_error(file).find("overlap or hole"), std::string::npos);
  } catch (const std::bad_alloc&) {
    FAIL() << "the reader allocated the aliasing tensors before refusing them";
  }
}

TEST(Safetensors, RejectsHeadersOver100MbWithoutReadingThem) {
  std::string declared(8, '\0');
  const uint64_t n = 100'000'001;  // one byte over the reference library's limit
  std::memcpy(declared.data(), &n, 8);
  EXPECT_NE(parse_error(declared + "{}").find("over the 100 MB limit"), std::string::npos);
  std::string huge(8, '\xff');
  EXPECT_NE(parse_error(huge).find("over the 100 MB limit"), std::string::npos);
}

TEST(Safetensors, RejectsTruncatedFiles) {
  const fs::path d = temp_dir("truncated");
  io::NamedTensors in;
  in.emplace_back("a", Tensor::from<float>({2, 2}, {1, 2, 3, 4}));
  in.emplace_back("b", Tensor::from<float>({3}, {5, 6, 7}));
  io::write_safetensors(d / "a.safetensors", in);
  const std::string whole = read_file(d / "a.safetensors");
  EXPECT_EQ(parse_error(whole), "");
  // Cut inside the data, inside the header and inside the length.
  EXPECT_NE(parse_error(whole.substr(0, whole.size() - 1)).find("the file is truncated"),
            std::string::npos);
  EXPECT_NE(parse_error(whole.substr(0, 20)).find("it is truncated"), std::string::npos);
  EXPECT_NE(parse_error(whole.substr(0, 5)).find("too short"), std::string::npos);
  // On disk too, naming the file.
  write_file_atomic(d / "cut.safetensors", whole.substr(0, whole.size() - 4));
  try {
    io::read_safetensors(d / "cut.safetensors");
    ADD_FAILURE() << "a truncated file was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cut.safetensors"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

TEST(Checkpoint, CommitVerifyCorruptSkipAndRetain) {
  const fs::path root = temp_dir("ckpt");
  auto write = [&](int64_t step) {
    io::CheckpointWriter w(root, step);
    w.add_tensors("model.safetensors",
                  {{"w", Tensor::full({4, 4}, static_cast<double>(step), DType::f32)}});
    w.add_text("state.json", "{\"step\": " + std::to_string(step) + "}");
    return w.commit();
  };
  const fs::path c1 = write(1), c2 = write(2), c3 = write(3);
  EXPECT_EQ(c3.filename(), "step-00000003");
  EXPECT_FALSE(io::verify_checkpoint(c3).has_value());
  EXPECT_EQ(io::checkpoint_step(c3), 3);
  const auto manifest = nlohmann::json::parse(read_file(c3 / "manifest.json"));
  EXPECT_EQ(manifest["files"]["state.json"]["sha256"], sha256_file(c3 / "state.json"));

  // Flip one byte of the newest weights: resume skips it, naming the file.
  {
    std::fstream f(c3 / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  // Truncate the second newest's state, and leave a half-written temp folder behind.
  fs::resize_file(c2 / "state.json", 3);
  fs::create_directories(root / ".tmp-step-00000004.999999");
  std::ofstream(root / ".tmp-step-00000004.999999" / "model.safetensors") << "partial";
  const auto choice = io::choose_resume_checkpoint(root);
  ASSERT_TRUE(choice.dir.has_value());
  EXPECT_EQ(*choice.dir, c1);
  ASSERT_EQ(choice.skipped.size(), 2u);
  EXPECT_EQ(choice.skipped[0].first, c3);
  EXPECT_NE(choice.skipped[0].second.find("model.safetensors has SHA-256"), std::string::npos);
  EXPECT_NE(choice.skipped[1].second.find("state.json holds 3 bytes"), std::string::npos);

  // A corrupt folder of the same step is replaced by a new commit.
  write(3);
  EXPECT_FALSE(io::verify_checkpoint(c3).has_value());
  fs::remove(c1 / "manifest.json");
  EXPECT_EQ(*io::verify_checkpoint(c1), "manifest.json is missing");

  // A copy under another step's name is not that step: resume passes over it.
  fs::create_directories(root / "step-00000007");
  for (const auto& e : fs::directory_iterator(c3)) fs::copy(e.path(), root / "step-00000007");
  EXPECT_EQ(*io::verify_checkpoint(root / "step-00000007"),
            "the folder is named 'step-00000007' but manifest.json says step 3");
  EXPECT_EQ(*io::verify_checkpoint(root.string() + "/step-00000007/"),
            "the folder is named 'step-00000007' but manifest.json says step 3");
  // A copy kept under a name of its own is taken.
  fs::copy(root / "step-00000007", root / "step-00000007-best");
  EXPECT_FALSE(io::verify_checkpoint(root / "step-00000007-best").has_value());
  fs::remove_all(root / "step-00000007-best");
  EXPECT_EQ(*io::choose_resume_checkpoint(root).dir, c3);
  fs::remove_all(root / "step-00000007");

  write(5);
  const auto removed = io::apply_retention(root, 2);
  EXPECT_EQ(io::list_checkpoints(root), (std::vector<fs::path>{c3, root / "step-00000005"}));
  EXPECT_FALSE(fs::exists(root / ".tmp-step-00000004.999999"));
  EXPECT_EQ(removed.size(), 3u);
  fs::remove_all(root);
}

// A checkpoint that fails to verify is moved aside for inspection; one set aside earlier at the
// same step (a second corruption after a resume) is kept beside it, not replaced.
TEST(Checkpoint, CorruptCheckpointsSetAsideAtOneStepAreAllKept) {
  const fs::path root = temp_dir("ckpt_aside");
  auto write = [&](int64_t step) {
    io::CheckpointWriter w(root, step);
    w.add_text("state.json", "{\"step\": " + std::to_string(step) + "}");
    return w.commit();
  };
  write(1);
  for (const std::string first : {"first", "second"}) {
    const fs::path c2 = write(2);
    write_file_atomic(c2 / "state.json", first);  // no longer what the manifest says
    const auto point = io::choose_checkpoint_to_resume(root, "test");
    ASSERT_TRUE(point.dir.has_value());
    EXPECT_EQ(point.dir->filename(), "step-00000001");
  }
  EXPECT_EQ(read_file(root / ".corrupt-step-00000002" / "state.json"), "first");
  EXPECT_EQ(read_file(root / ".corrupt-step-00000002.2" / "state.json"), "second");
  fs::remove_all(root);
}

// A manifest that is valid JSON but of the wrong shape is a reason to skip its checkpoint, not an
// error that stops the resume; a manifest naming a file outside its folder fails to verify; a
// folder whose step does not fit in int64 is no checkpoint.
TEST(Checkpoint, HostileManifestsAreSkippedWithAReason) {
  const fs::path root = temp_dir("ckpt_hostile");
  auto write = [&](int64_t step) {
    io::CheckpointWriter w(root, step);
    w.add_text("state.json", "{}");
    return w.commit();
  };
  const fs::path good = write(1), bad = write(2);
  const std::vector<std::pair<std::string, std::string>> manifests = {
      {R"({"step": 2, "files": {"state.json": {"bytes": "2", "sha256": 1}}})",
       "lacks bytes (a count) or sha256 (a string)"},
      {R"({"step": 2, "files": {"state.json": 7}})", "lacks bytes (a count) or sha256"},
      {R"({"step": "2", "files": {}})", "lacks 'step' (an integer) or 'files'"},
      {R"({"step": 2, "files": {"../step-00000001/state.json": {"bytes": 2, "sha256": "x"}}})",
       "not a file of the checkpoint's folder"},
  };
  for (const auto& [manifest, reason] : manifests) {
    write_file_atomic(bad / "manifest.json", manifest);
    const auto choice = io::choose_resume_checkpoint(root);
    ASSERT_EQ(choice.dir, good) << manifest;
    ASSERT_EQ(choice.skipped.size(), 1u);
    EXPECT_NE(choice.skipped[0].second.find(reason), std::string::npos)
        << manifest << ": " << choice.skipped[0].second;
  }
  fs::create_directories(root / "step-99999999999999999999");
  EXPECT_EQ(io::list_checkpoints(root), (std::vector<fs::path>{good, bad}));
  fs::remove_all(root);
}

// write_synced gathers pieces of any size (empty ones too) into large writes across chunk
// boundaries; the file holds their concatenation and the hash, taken from memory on another
// thread, is the file's.
TEST(SyncedWrite, PiecesOfAnySizeMakeTheFileAndItsHash) {
  const fs::path d = temp_dir("synced");
  std::vector<std::string> parts = {"head", "", std::string(3, 'x')};
  std::string big(size_t{21} << 20, '\0');  // crosses a 16 MiB write block
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 2654435761u >> 13);
  parts.push_back(big);
  parts.push_back("");
  parts.push_back(std::string(5000, 'y'));
  io::ByteSpans pieces;
  std::string expected;
  for (const auto& p : parts) {
    pieces.push_back(std::as_bytes(std::span(p)));
    expected += p;
  }
  const auto s = io::write_synced(d / "f.bin", pieces);
  EXPECT_EQ(s.bytes, expected.size());
  EXPECT_EQ(read_file(d / "f.bin"), expected);
  EXPECT_EQ(s.sha256, sha256_hex(expected));
  EXPECT_EQ(s.sha256, sha256_file(d / "f.bin"));
  const auto empty = io::write_synced(d / "e.bin", io::ByteSpans{});
  EXPECT_EQ(empty.bytes, 0u);
  EXPECT_EQ(empty.sha256, sha256_hex(""));
  EXPECT_EQ(fs::file_size(d / "e.bin"), 0u);
  fs::remove_all(d);
}

// A disk that takes no more bytes is an error naming the file and the cause, not a short file.
TEST(SyncedWrite, AFullDiskIsAClearError) {
  const std::string data(size_t{3} << 20, 'z');
  try {
    io::write_synced("/dev/full", data);
    FAIL() << "writing to /dev/full succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write '/dev/full' at byte 0"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOSPC)), std::string::npos) << e.what();
  }
}

// The manifest lists files in the order added, and a writer dropped before commit leaves
// nothing behind.
TEST(Checkpoint, ManifestKeepsFileOrderAndAnUncommittedWriterLeavesNothing) {
  const fs::path root = temp_dir("ckpt_parallel");
  const Tensor big = Tensor::full({1024, 1024}, 0.5, DType::f32);
  {
    io::CheckpointWriter w(root, 7);
    w.add_tensors("b.safetensors", {{"w", big}});
    w.add_text("a.json", "{}");
    w.add_tensors("c.safetensors", {{"v", Tensor::full({3}, 2.0, DType::f32)}});
  }  // dropped: no checkpoint, no temp folder
  EXPECT_TRUE(fs::is_empty(root));
  io::CheckpointWriter w(root, 7);
  w.add_tensors("b.safetensors", {{"w", big}});
  w.add_text("a.json", "{}");
  w.add_tensors("c.safetensors", {{"v", Tensor::full({3}, 2.0, DType::f32)}});
  const fs::path dir = w.commit();
  EXPECT_FALSE(io::verify_checkpoint(dir).has_value());
  const auto m = nlohmann::ordered_json::parse(read_file(dir / "manifest.json"));
  std::vector<std::string> names;
  for (const auto& [name, info] : m["files"].items()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"b.safetensors", "a.json", "c.safetensors"}));
  EXPECT_EQ(w.stats().bytes,
            fs::file_size(dir / "b.safetensors") + 2 + fs::file_size(dir / "c.safetensors"));
  const auto back = io::read_safetensors(dir / "b.safetensors");
  EXPECT_EQ(std::memcmp(back.find("w")->raw(), big.raw(), big.nbytes()), 0);
  fs::remove_all(root);
}
