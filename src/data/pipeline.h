#pragma once
// `pollen data prepare`: the curation pipeline from raw files to curated JSONL, token shards and
// a manifest. Stages, in order:
//   read -> utf8 -> length -> gopher_quality -> gopher_repetition -> c4 -> fineweb
//   -> exact_dedup -> minhash -> pii -> decontaminate -> split -> tokenize
// Every document that enters a stage leaves it kept or dropped with a reason; the manifest
// holds the counts (documents and bytes) of every stage. docs/data.md documents every key.
//
// Two streaming passes with bounded memory, each in batches through three overlapping stages:
// one thread reads the next batch while the thread pool processes the current one and another
// thread merges the previous one, in input order (so outputs do not depend on the thread
// count). Pass 1 reads, filters and exact-deduplicates, and keeps one MinHash signature per
// surviving document; pass 2 streams the survivors again, dropping near-duplicates, redacting
// PII, decontaminating, splitting and tokenising. Pass 1's outputs are written atomically with
// a key of the config and inputs; a rerun after an interruption skips pass 1 when they match,
// or continues it from its last resume point (saved where an input file ends, after every
// checkpoint_bytes of text). Pass 2 saves resume points (after each completed shard and every
// checkpoint_bytes of text) from which a rerun continues; a rerun of a finished run does nothing.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/filters.h"
#include "data/minhash.h"
#include "data/pii.h"
#include "data/readers.h"

namespace pollen::data {

struct PipelineConfig {
  std::string source;              // the config file, named by errors
  std::filesystem::path base_dir;  // relative paths in the config resolve against this
  std::filesystem::path output;
  int threads = 0;  // 0: all hardware threads
  std::vector<SourceSpec> sources;
  ReadLimits limits;
  bool fail_on_bad_input = false;
  int64_t batch_bytes = 16 << 20;                 // text per processing batch
  int64_t checkpoint_bytes = int64_t{256} << 20;  // pass 2 text between resume points
  std::string utf8 = "repair";                    // "repair" or "drop"
  bool normalize_newlines = true;                 // CRLF and CR to LF
  LengthFilter length;
  GopherQualityFilter gopher_quality;
  GopherRepetitionFilter gopher_repetition;
  C4Filter c4;
  FineWebFilter fineweb;
  bool exact_dedup = true;
  MinHashOptions minhash;
  PiiOptions pii;
  bool decontaminate = false;
  int decontaminate_ngram = 13;
  std::vector<std::string> eval_files;  // JSONL (text_field) or plain text (whole file)
  std::string eval_text_field = "text";
  double validation_fraction = 0.01;
  uint64_t split_seed = 0;
  bool tokenize = true;
  std::string tokenizer;  // HF tokenizer.json
  bool add_bos = false, add_eos = true;
  std::string bos_token, eos_token;  // "" = from the tokenizer's template or usual names
  int64_t shard_tokens = int64_t{1} << 27;
  std::string prefix = "data";

  static PipelineConfig load(const std::filesystem::path& path);
  // The same from TOML text, as if read from `path` (relative paths resolve against its folder;
  // errors name it).
  static PipelineConfig parse(const std::string& text, const std::filesystem::path& path);
  // The resolved config as it goes into the manifest (every key, no output folder).
  nlohmann::json to_json() const;
};

struct PrepareOptions {
  bool progress = true;
  // For tests of resumption: "pass1" stops after pass 1.
  std::string stop_after;
  // For tests of resumption: when positive, pass 2 fails after merging this many batches (and
  // saving a resume point if one was due), as if interrupted.
  int64_t interrupt_pass2_after = 0;
  // For tests of resumption: pass 2 fails once its outputs are renamed into place, before the
  // manifest is written.
  bool interrupt_before_manifest = false;
  // For tests of resumption: when positive, pass 1 fails after saving this many resume points.
  int64_t interrupt_pass1_after = 0;
};

// Runs the pipeline; returns the manifest's path.
std::filesystem::path prepare(const PipelineConfig& config, const PrepareOptions& options = {});

// Human-readable summary of a dataset (version, splits, stages); `manifest` may be the
// manifest file or its folder.
std::string dataset_stats(const std::filesystem::path& manifest);

// Documents `first`..`first + count` of a split, with their token ids and (when the dataset's
// tokenizer file is present) their decoded text.
std::string inspect_documents(const std::filesystem::path& manifest, const std::string& split,
                              int64_t first, int64_t count, int64_t max_ids);

}  // namespace pollen::data
