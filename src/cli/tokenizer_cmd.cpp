// `pollen tokenizer train|count|encode|decode|info|convert|bench`: parsing and wiring; the work is
// in src/tokenizer.
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "base/error.h"
#include "base/files.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "cli/commands.h"
#include "tokenizer/documents.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"
#include "tokenizer/vocab.h"

namespace pollen::cli {
namespace {

namespace tk = pollen::tokenizer;

struct TokenizerArgs {
  std::string file;
  std::string pattern;
  std::vector<std::string> specials;  // TOKEN=ID
};

void add_tokenizer_args(CLI::App* cmd, TokenizerArgs& a) {
  cmd->add_option("--tokenizer", a.file, "tokenizer.json, or a tiktoken rank file")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--pattern", a.pattern,
                  "For a rank file: gpt2, cl100k_base, o200k_base, qwen2, or a regex");
  cmd->add_option("--add-special", a.specials, "For a rank file: an extra special token, TOKEN=ID");
}

// A token id written in decimal, the whole of `text`, below `limit`; nothing otherwise.
std::optional<uint32_t> parse_token_id(std::string_view text, uint64_t limit) {
  uint64_t id = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), id);
  if (ec != std::errc() || end != text.data() + text.size() || id >= limit) return std::nullopt;
  return static_cast<uint32_t>(id);
}

tk::Tokenizer open(const TokenizerArgs& a) {
  std::vector<tk::AddedToken> specials;
  for (const std::string& s : a.specials) {
    size_t eq = s.rfind('=');
    POLLEN_CHECK(eq != std::string::npos && eq > 0, "--add-special '", s, "': expected TOKEN=ID");
    const auto id = parse_token_id(std::string_view(s).substr(eq + 1), tk::kMaxTokenId);
    POLLEN_CHECK(id.has_value(), "--add-special '", s, "': the id is not a number below 2^24");
    specials.push_back({*id, s.substr(0, eq)});
  }
  return tk::open_tokenizer(a.file, a.pattern, std::move(specials));
}

tk::SpecialPolicy special_policy(const std::string& mode) {
  if (mode == "allow") return tk::SpecialPolicy::allow_all();
  if (mode == "text") return tk::SpecialPolicy::as_text();
  return tk::SpecialPolicy::refuse_all();
}

// A document's ids as --output holds them: little-endian uint32 for a .bin file, else one line.
std::string id_bytes(const std::vector<uint32_t>& ids, bool binary) {
  if (binary)
    return std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(uint32_t));
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  return line + '\n';
}

// A rank file holds only the ranks: the special tokens are lost unless given again where the
// file is used; says so for each, naming the --add-special that gives it back.
void warn_specials_left_out(const tk::Tokenizer& tok, const std::string& output,
                            const char* command) {
  if (std::filesystem::path(output).extension() == ".json") return;
  for (const auto& t : tok.added_tokens())
    std::fprintf(stderr,
                 "pollen tokenizer %s: '%s' (id %u) is not stored in the rank file '%s' (a rank "
                 "file holds no special tokens): give it where the file is used as "
                 "--add-special '%s=%u', or write a tokenizer.json\n",
                 command, t.content.c_str(), t.id, output.c_str(), t.content.c_str(), t.id);
}

void add_train(CLI::App* parent) {
  auto* cmd = parent->add_subcommand("train", "Train a byte-level BPE tokenizer");
  struct Args {
    std::vector<std::string> inputs, counts;
    bool jsonl = false;
    std::string field = "text", pattern = "cl100k_base", output;
    uint32_t vocab_size = 32000;
    std::vector<std::string> specials;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  auto* inputs_opt =
      cmd->add_option("--input", a->inputs, "Text files (a line is a document) or JSONL files")
          ->check(CLI::ExistingFile);
  auto* counts_opt =
      cmd->add_option("--counts", a->counts,
                      "Count files of `pollen tokenizer count` (one per silo), merged and trained "
                      "on instead of text; the pattern is theirs")
          ->check(CLI::ExistingFile);
  inputs_opt->excludes(counts_opt);
  cmd->add_flag("--jsonl", a->jsonl, "Inputs are JSONL; the text is in --field");
  cmd->add_option("--field", a->field,
                  "JSONL field holding the text (a list of chat messages: their contents)")
      ->capture_default_str();
  cmd->add_option("--vocab-size", a->vocab_size, "Tokens in all: 256 bytes, merges, specials")
      ->capture_default_str();
  cmd->add_option("--special", a->specials, "Special tokens, given ids after the merges");
  auto* pattern =
      cmd->add_option("--pattern", a->pattern, "Pre-tokenisation: a known pattern name or a regex")
          ->capture_default_str();
  cmd->add_option("--output", a->output, "tokenizer.json, or any other name for a rank file")
      ->required();
  cmd->add_option("--threads", a->threads, "Threads (default: all)");
  cmd->callback([a, pattern] {
    if (a->threads > 0) set_num_threads(a->threads);
    POLLEN_CHECK(!a->inputs.empty() || !a->counts.empty(),
                 "tokenizer train: give --input files or --counts files");
    tk::check_special_tokens(a->specials, a->vocab_size, "--special");  // before the counting
    check_writable(a->output, "--output");
    for (size_t i = 0; i < a->counts.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        POLLEN_CHECK(!std::filesystem::equivalent(a->counts[i], a->counts[j]), "--counts: '",
                     a->counts[i], "' is given twice (its counts would be added twice)");
    auto start = std::chrono::steady_clock::now();
    std::string regex = tk::pattern_regex(a->pattern);
    if (!a->counts.empty()) {
      std::string theirs = tk::PieceCounts::file_pattern(a->counts.front());
      POLLEN_CHECK(pattern->count() == 0 || theirs == regex, "--pattern '", a->pattern,
                   "' differs from the pattern of '", a->counts.front(), "'");
      regex = theirs;
    }
    // A regex that does not compile is named by where it came from.
    const std::string regex_from =
        a->counts.empty() ? "--pattern" : cat("the pattern of '", a->counts.front(), "'");
    std::optional<tk::PieceCounts> counted;
    try {
      counted.emplace(regex);
    } catch (const Error& e) {
      fail(regex_from, ": ", e.what());
    }
    tk::PieceCounts& counts = *counted;
    for (const std::string& input : a->inputs) counts.add_file(input, a->jsonl, a->field);
    for (const std::string& file : a->counts) counts.merge_file(file);
    std::optional<tk::Tokenizer> trained;
    try {
      trained.emplace(tk::train_bpe(counts, {a->vocab_size, a->specials, counts.pattern()}));
    } catch (const Error& e) {
      std::string files;
      for (const std::string& file : a->counts)
        files += cat(files.empty() ? "" : ", ", "'", file, "'");
      fail(e.what(), files.empty() ? std::string() : cat(" (--counts ", files, ")"));
    }
    const tk::Tokenizer& tok = *trained;
    tk::save_tokenizer(tok, a->output);
    warn_specials_left_out(tok, a->output, "train");
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "trained %u tokens on %.1f MB (%zu distinct pieces) in %.1f s: %s\n",
                 tok.vocab_size(), counts.bytes_read() / 1e6, counts.distinct(), seconds,
                 a->output.c_str());
    std::fprintf(stderr, "fingerprint %s\n", tok.fingerprint().c_str());
    if (tok.vocab_size() < a->vocab_size)
      std::fprintf(stderr,
                   "pollen tokenizer train: %u tokens, not the %u asked for: the text has no "
                   "more pairs to merge (more text, or a smaller --vocab-size)\n",
                   tok.vocab_size(), a->vocab_size);
  });
}

void add_count(CLI::App* parent) {
  auto* cmd = parent->add_subcommand(
      "count", "Count a silo's pre-tokenised pieces into a file for federated tokenizer training");
  struct Args {
    std::vector<std::string> inputs;
    bool jsonl = false;
    std::string field = "text", pattern = "cl100k_base", output;
    double noise = 0;
    uint64_t seed = 0, min_count = 1;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--input", a->inputs, "Text files (a line is a document) or JSONL files")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--jsonl", a->jsonl, "Inputs are JSONL; the text is in --field");
  cmd->add_option("--field", a->field,
                  "JSONL field holding the text (a list of chat messages: their contents)")
      ->capture_default_str();
  cmd->add_option("--pattern", a->pattern, "Pre-tokenisation: a known pattern name or a regex")
      ->capture_default_str();
  cmd->add_option("--output", a->output, "The count file to write")->required();
  cmd->add_option("--noise-stddev", a->noise,
                  "Add round(N(0, S^2)) to every count before writing (0: exact counts)")
      ->capture_default_str();
  auto* seed_option = cmd->add_option("--seed", a->seed,
                                      "Seed of the noise (default: drawn from the OS; one who "
                                      "knows it can subtract the noise)")
                          ->check(seed_number());
  cmd->add_option("--min-count", a->min_count, "Drop pieces counted fewer times (before noise)")
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "Threads (default: all)");
  cmd->callback([a, seed_option] {
    if (a->threads > 0) set_num_threads(a->threads);
    check_writable(a->output, "--output");  // before the counting
    tk::PieceCounts counts(tk::pattern_regex(a->pattern));
    for (const std::string& input : a->inputs) counts.add_file(input, a->jsonl, a->field);
    const size_t before = counts.distinct();
    // Checked here too: a negative or NaN stddev must not quietly send exact counts.
    POLLEN_CHECK(std::isfinite(a->noise) && a->noise >= 0, "--noise-stddev ", a->noise,
                 ": expected a finite value >= 0");
    if (a->noise > 0 || a->min_count > 1)
      counts.perturb(a->noise, seed_option->count() > 0 ? a->seed : os_entropy_u64(), a->min_count);
    counts.save(a->output);
    std::printf("counted %zu distinct pieces in %.1f MB (%zu written): %s\n", before,
                counts.bytes_read() / 1e6, counts.distinct(), a->output.c_str());
  });
}

void add_encode(CLI::App* parent) {
  auto* cmd = parent->add_subcommand("encode", "Encode text into token ids");
  struct Args {
    TokenizerArgs tok;
    std::string input, field = "text", output = "-", special = "refuse";
    bool jsonl = false, bos_eos = false;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  add_tokenizer_args(cmd, a->tok);
  cmd->add_option("--input", a->input,
                  "Text file (a line is a document, its line break not "
                  "included) or JSONL (--jsonl)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--jsonl", a->jsonl, "Input is JSONL; each record's --field is a document");
  cmd->add_option("--field", a->field,
                  "JSONL field holding the text (a list of chat messages: their contents)")
      ->capture_default_str();
  cmd->add_option("--output", a->output,
                  "ids.bin (uint32, documents one after another), a text file (one line of ids "
                  "per document), or - for stdout")
      ->capture_default_str();
  cmd->add_option("--special", a->special,
                  "Special tokens in the text: refuse (an error), allow, or text")
      ->check(CLI::IsMember({"refuse", "allow", "text"}))
      ->capture_default_str();
  cmd->add_flag("--bos-eos", a->bos_eos, "Add the tokenizer's BOS/EOS template");
  cmd->add_option("--threads", a->threads, "Threads (default: all)");
  cmd->callback([a] {
    if (a->threads > 0) set_num_threads(a->threads);
    if (a->output != "-") check_writable(a->output, "--output");
    tk::Tokenizer tok = open(a->tok);
    tk::EncodeOptions options{special_policy(a->special), a->bos_eos};
    const bool binary = a->output.ends_with(".bin");
    const auto encode_all = [&](const FileSink& sink) {
      tk::for_each_document_batch(
          {a->input, a->jsonl, a->field, false}, 16 << 20,
          [&](std::span<const std::string_view> docs, std::span<const size_t> lines) {
            std::vector<std::vector<uint32_t>> batch;
            try {
              batch = tok.encode_batch(docs, options);
            } catch (const Error&) {
              // A special token in the text that --special refuse does not allow. The batch ran
              // on many threads: the first document in file order that fails is the one to name,
              // by the line it starts on.
              for (size_t i = 0; i < docs.size(); ++i) {
                try {
                  tok.encode(docs[i], options);
                } catch (const Error& e) {
                  fail(a->input, ":", lines[i], ": ", e.what(),
                       a->special == "refuse" ? "; --special allow or --special text" : "");
                }
              }
              throw;
            }
            for (const auto& ids : batch) sink(id_bytes(ids, binary));
          });
    };
    if (a->output != "-") {
      // Atomically: a run that fails (a full disk) leaves no truncated ids looking whole.
      write_file_atomic_by(a->output, encode_all);
      return;
    }
    encode_all([](std::string_view bytes) {
      std::cout.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    });
    std::cout.flush();
    POLLEN_CHECK(std::cout.good(), "cannot write to standard output: ", std::strerror(errno));
  });
}

void add_decode(CLI::App* parent) {
  auto* cmd = parent->add_subcommand("decode", "Decode token ids into text");
  struct Args {
    TokenizerArgs tok;
    std::string input, output = "-";
  };
  auto a = std::make_shared<Args>();
  add_tokenizer_args(cmd, a->tok);
  cmd->add_option("--input", a->input, "ids.bin (uint32) or text (one line of ids a document)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--output", a->output, "Text file, or - for stdout")->capture_default_str();
  cmd->callback([a] {
    if (a->output != "-") check_writable(a->output, "--output");
    tk::Tokenizer tok = open(a->tok);
    std::string data = read_file(a->input), text;
    const uint64_t vocab = tok.vocab_size();
    // Decoded with the place of a failure (an id with no bytes: a hole in the vocabulary).
    const auto decode = [&](const std::vector<uint32_t>& ids, const std::string& where) {
      try {
        return tok.decode(ids);
      } catch (const Error& e) {
        fail(where, ": ", e.what());
      }
    };
    if (a->input.ends_with(".bin")) {
      POLLEN_CHECK(data.size() % 4 == 0, a->input, ": size is not a multiple of 4 bytes");
      std::vector<uint32_t> ids(data.size() / 4);
      std::memcpy(ids.data(), data.data(), data.size());
      for (size_t i = 0; i < ids.size(); ++i)
        POLLEN_CHECK(ids[i] < vocab, a->input, ": id ", ids[i], " at position ", i,
                     " is not a token id (0 to ", vocab - 1, ")");
      text = decode(ids, a->input);
    } else {
      std::istringstream lines(data);
      size_t number = 0;
      for (std::string line; std::getline(lines, line);) {
        ++number;
        std::istringstream words(line);
        std::vector<uint32_t> ids;
        for (std::string w; words >> w;) {
          const auto id = parse_token_id(w, vocab);
          POLLEN_CHECK(id.has_value(), a->input, ":", number, ": '", w,
                       "' is not a token id (0 to ", vocab - 1, ")");
          ids.push_back(*id);
        }
        text += decode(ids, cat(a->input, ":", number)) + "\n";
      }
    }
    if (a->output == "-") {
      POLLEN_CHECK(std::fwrite(text.data(), 1, text.size(), stdout) == text.size() &&
                       std::fflush(stdout) == 0,
                   "cannot write to standard output: ", std::strerror(errno));
    } else {
      write_file_atomic(a->output, text);
    }
  });
}

void add_info(CLI::App* parent) {
  auto* cmd =
      parent->add_subcommand("info", "Vocabulary size, special tokens, pattern, fingerprint");
  auto a = std::make_shared<TokenizerArgs>();
  add_tokenizer_args(cmd, *a);
  cmd->callback([a] {
    tk::Tokenizer tok = open(*a);
    const auto& model = tok.model();
    // A tokenizer.json may list its added tokens in the model's vocabulary too (pollen's do, as
    // HF's trainer does): they are counted once, as added tokens.
    size_t bpe = model.vocab().size();
    for (const tk::AddedToken& t : tok.added_tokens()) bpe -= model.vocab().contains(t.id);
    std::printf("vocab size   %u (%zu BPE tokens, %zu merges, %zu added)\n", tok.vocab_size(), bpe,
                model.merges().size(), tok.added_tokens().size());
    std::printf("kind         %s\n", model.options().alphabet == tk::Alphabet::kBytes
                                         ? "byte-level BPE"
                                         : "SentencePiece-style BPE");
    std::printf("pattern      %s\n", tok.pattern().empty() ? "(none)" : tok.pattern().c_str());
    for (const tk::AddedToken& t : tok.added_tokens())
      std::printf("%s %u %s\n", t.special ? "special     " : "added       ", t.id,
                  t.content.c_str());
    std::printf("fingerprint  %s\n", tok.fingerprint().c_str());
  });
}

void add_convert(CLI::App* parent) {
  auto* cmd = parent->add_subcommand(
      "convert",
      "Write a tokenizer in the other format (tokenizer.json <-> tiktoken rank file) and print "
      "the written file's fingerprint, the source's unless the two formats state the tokenizer "
      "differently (then it says so); a rank file holds neither the pattern nor special tokens: "
      "open it with --pattern and each --add-special this command names");
  struct Args {
    TokenizerArgs tok;
    std::string output;
  };
  auto a = std::make_shared<Args>();
  add_tokenizer_args(cmd, a->tok);
  cmd->add_option("--output", a->output, "tokenizer.json, or any other name for a rank file")
      ->required();
  cmd->callback([a] {
    check_writable(a->output, "--output");
    tk::Tokenizer tok = open(a->tok);
    try {
      tk::save_tokenizer(tok, a->output);
    } catch (const Error& e) {
      fail("'", a->tok.file, "' cannot be written as '", a->output, "': ", e.what());
    }
    warn_specials_left_out(tok, a->output, "convert");
    // The fingerprint configs need is the written file's, opened as it will be (a rank file with
    // the pattern and the special tokens named above).
    TokenizerArgs written{a->output, "", {}};
    if (std::filesystem::path(a->output).extension() != ".json") {
      written.pattern = tok.pattern();
      for (const auto& t : tok.added_tokens())
        written.specials.push_back(t.content + "=" + std::to_string(t.id));
    }
    const std::string fingerprint = open(written).fingerprint();
    if (fingerprint != tok.fingerprint())
      std::fprintf(stderr,
                   "pollen tokenizer convert: '%s' reads back with fingerprint %s, not the "
                   "source's %s: a rank file holds tiktoken's rule (a piece in the vocabulary is "
                   "one token) and its pattern as one regex, which '%s' states otherwise; configs "
                   "that use the written file need its fingerprint\n",
                   a->output.c_str(), fingerprint.c_str(), tok.fingerprint().c_str(),
                   a->tok.file.c_str());
    std::fprintf(stderr, "wrote %s (fingerprint %s)\n", a->output.c_str(), fingerprint.c_str());
  });
}

void add_bench(CLI::App* parent) {
  auto* cmd = parent->add_subcommand(
      "bench", "Encode throughput on one thread and on all threads (JSON lines)");
  struct Args {
    TokenizerArgs tok;
    std::string input, field = "text";
    bool jsonl = false;
    int repeat = 3;
  };
  auto a = std::make_shared<Args>();
  add_tokenizer_args(cmd, a->tok);
  cmd->add_option("--input", a->input, "Text or JSONL file of documents")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--jsonl", a->jsonl, "Input is JSONL");
  cmd->add_option("--field", a->field,
                  "JSONL field holding the text (a list of chat messages: their contents)")
      ->capture_default_str();
  cmd->add_option("--repeat", a->repeat, "Best of this many runs")
      ->check(one_or_more())
      ->capture_default_str();
  cmd->callback([a] {
    tk::Tokenizer tok = open(a->tok);
    std::vector<std::string> docs;
    size_t bytes = 0;
    tk::for_each_document_batch({a->input, a->jsonl, a->field, true}, 64 << 20,
                                [&](std::span<const std::string_view> batch) {
                                  for (std::string_view d : batch) {
                                    docs.emplace_back(d);
                                    bytes += d.size();
                                  }
                                });
    std::vector<std::string_view> views(docs.begin(), docs.end());
    tk::EncodeOptions options{tk::SpecialPolicy::as_text()};
    for (int threads : {1, num_threads()}) {
      set_num_threads(threads);
      double best = 1e30;
      size_t tokens = 0;
      for (int r = 0; r < a->repeat; ++r) {
        auto start = std::chrono::steady_clock::now();
        auto ids = tok.encode_batch(views, options);
        best = std::min(
            best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        tokens = 0;
        for (const auto& d : ids) tokens += d.size();
      }
      std::printf(
          "{\"encoder\": \"pollen\", \"threads\": %d, \"bytes\": %zu, \"tokens\": %zu, "
          "\"seconds\": %.4f, \"mb_per_s\": %.2f}\n",
          threads, bytes, tokens, best, bytes / best / 1e6);
    }
  });
}

}  // namespace

void add_tokenizer_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenizer", "Train, use and inspect BPE tokenizers");
  cmd->require_subcommand(1);
  add_train(cmd);
  add_count(cmd);
  add_encode(cmd);
  add_decode(cmd);
  add_info(cmd);
  add_convert(cmd);
  add_bench(cmd);
}

}  // namespace pollen::cli
