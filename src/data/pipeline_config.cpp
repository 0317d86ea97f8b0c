// PipelineConfig: the `pollen data prepare` config read from TOML (every key checked against
// what it may hold) and written back as JSON, as it goes into the manifest. docs/data.md
// documents every key.
#include "data/pipeline.h"

#include "base/config.h"
#include "base/error.h"

namespace pollen::data {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

PipelineConfig read_pipeline_config(ConfigTable& t, const fs::path& path) {
  PipelineConfig c;
  c.source = path.string();
  c.base_dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::string out = t.require_string("output");
  POLLEN_CHECK(!out.empty(), t.where("output"), ": expected a folder to write the dataset to");
  c.output = (fs::path(out).is_absolute() ? fs::path(out) : c.base_dir / out).lexically_normal();
  c.threads = static_cast<int>(t.get_int_in("threads", 0, 0, kConfigThreadsMax));
  c.fail_on_bad_input = t.get_bool("fail_on_bad_input", false);
  c.batch_bytes = t.get_int("batch_bytes", c.batch_bytes);
  POLLEN_CHECK(c.batch_bytes > 0, t.where("batch_bytes"), ": must be positive");
  c.checkpoint_bytes = t.get_int("checkpoint_bytes", c.checkpoint_bytes);
  POLLEN_CHECK(c.checkpoint_bytes > 0, t.where("checkpoint_bytes"), ": must be positive");
  c.limits.max_line_bytes =
      t.get_int_in("max_line_bytes", c.limits.max_line_bytes, 1, kConfigIntMax);
  c.limits.max_doc_bytes = t.get_int_in("max_doc_bytes", c.limits.max_doc_bytes, 1, kConfigIntMax);
  auto names = t.get_strings("sources");
  POLLEN_CHECK(!names.empty(), t.where("sources"), ": list at least one source");
  auto src_table = t.table("source");
  POLLEN_CHECK(src_table.has_value(), t.where("source"),
               ": expected a [source.<name>] table for "
               "each name in 'sources'");
  for (size_t i = 0; i < names.size(); ++i)
    POLLEN_CHECK(std::find(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(i),
                           names[i]) == names.begin() + static_cast<std::ptrdiff_t>(i),
                 t.where("sources"), ": '", names[i], "' is listed twice");
  for (const auto& n : names) {
    // The prefix of its documents' ids (NAME/path): a '/' in it would let two sources' ids meet.
    POLLEN_CHECK(!n.empty() && n != "." && n != ".." &&
                     n.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos,
                 t.where("sources"), ": '", n,
                 "' cannot name a source: expected a name without '/' (its documents' ids start "
                 "with it)");
    auto st = src_table->table(n);
    POLLEN_CHECK(st.has_value(), t.where("source." + n), ": missing table for source '", n, "'");
    SourceSpec s;
    s.name = n;
    s.paths = st->get_strings("paths");
    POLLEN_CHECK(!s.paths.empty(), st->where("paths"), ": list at least one file or folder");
    s.format = st->get_string("format", s.format);
    POLLEN_CHECK(s.format == "text" || s.format == "delimited" || s.format == "jsonl",
                 st->where("format"), ": expected \"text\", \"delimited\" or \"jsonl\", got \"",
                 s.format, "\"");
    s.delimiter = st->get_string("delimiter", s.delimiter);
    POLLEN_CHECK(s.delimiter.find_first_of("\r\n") == std::string::npos, st->where("delimiter"),
                 ": a delimiter is compared with whole lines, so it cannot hold a line break");
    s.text_field = st->get_string("text_field", s.text_field);
    s.id_field = st->get_string("id_field", s.id_field);
    if (st->has("include")) s.include = st->get_strings("include");
    if (st->has("exclude")) s.exclude = st->get_strings("exclude");
    st->finish();
    c.sources.push_back(std::move(s));
  }
  src_table->finish();
  if (auto u = t.table("utf8")) {
    c.utf8 = u->get_string("invalid", c.utf8);
    POLLEN_CHECK(c.utf8 == "repair" || c.utf8 == "drop", u->where("invalid"),
                 ": expected \"repair\" or \"drop\"");
    c.normalize_newlines = u->get_bool("normalize_newlines", c.normalize_newlines);
    u->finish();
  }
  if (auto f = t.table("length")) load_filter(*f, c.length), f->finish();
  if (auto f = t.table("gopher_quality")) load_filter(*f, c.gopher_quality), f->finish();
  if (auto f = t.table("gopher_repetition")) load_filter(*f, c.gopher_repetition), f->finish();
  if (auto f = t.table("c4")) load_filter(*f, c.c4), f->finish();
  if (auto f = t.table("fineweb")) load_filter(*f, c.fineweb), f->finish();
  if (auto f = t.table("exact_dedup")) {
    c.exact_dedup = f->get_bool("enabled", c.exact_dedup);
    f->finish();
  }
  if (auto f = t.table("minhash")) {
    auto& m = c.minhash;
    m.enabled = f->get_bool("enabled", m.enabled);
    m.ngram = static_cast<int>(f->get_int_in("ngram", m.ngram, 1, 1 << 20));
    m.bands = static_cast<int>(f->get_int_in("bands", m.bands, 1, 1 << 20));
    m.rows = static_cast<int>(f->get_int_in("rows", m.rows, 1, 1 << 20));
    m.verify = f->get_bool("verify", m.verify);
    // A signature of bands * rows hashes per document: at most 2^20 (8 MiB a document).
    POLLEN_CHECK(int64_t{m.bands} * m.rows <= (1 << 20), f->where("bands"), " * rows (", m.bands,
                 " * ", m.rows, "): expected at most 1048576 hashes per signature");
    m.threshold = f->get_double("threshold", m.threshold);
    POLLEN_CHECK(m.threshold > 0 && m.threshold <= 1, f->where("threshold"),
                 ": expected a Jaccard similarity in (0, 1], got ", m.threshold);
    m.seed = static_cast<uint64_t>(
        f->get_int_in("seed", static_cast<int64_t>(m.seed), 0, kConfigIntMax));
    m.max_bucket_compare = f->get_int("max_bucket_compare", m.max_bucket_compare);
    f->finish();
  }
  if (auto f = t.table("pii")) {
    c.pii.enabled = f->get_bool("enabled", c.pii.enabled);
    for (int k = 0; k < kPiiTypes; ++k) {
      auto type = static_cast<PiiType>(k);
      c.pii.types[static_cast<size_t>(k)] = f->get_bool(pii_type_name(type), true);
    }
    f->finish();
  }
  if (auto f = t.table("decontaminate")) {
    c.eval_files = f->get_strings("eval_files");
    c.decontaminate = f->get_bool("enabled", !c.eval_files.empty());
    c.decontaminate_ngram =
        static_cast<int>(f->get_int_in("ngram", c.decontaminate_ngram, 1, 1 << 20));
    c.eval_text_field = f->get_string("text_field", c.eval_text_field);
    POLLEN_CHECK(!c.decontaminate || !c.eval_files.empty(), f->where("eval_files"),
                 ": decontamination needs at least one evaluation file");
    f->finish();
  }
  if (auto f = t.table("split")) {
    c.validation_fraction = f->get_double("validation_fraction", c.validation_fraction);
    POLLEN_CHECK(c.validation_fraction >= 0 && c.validation_fraction <= 1,
                 f->where("validation_fraction"), ": expected a number in [0, 1]");
    c.split_seed = static_cast<uint64_t>(f->get_int_in("seed", 0, 0, kConfigIntMax));
    f->finish();
  }
  if (auto f = t.table("tokenize")) {
    c.tokenize = f->get_bool("enabled", true);
    c.tokenizer = f->get_string("tokenizer", "");
    POLLEN_CHECK(!c.tokenize || !c.tokenizer.empty(), f->where("tokenizer"),
                 ": give a tokenizer.json file (or set enabled = false)");
    c.add_bos = f->get_bool("add_bos", c.add_bos);
    c.add_eos = f->get_bool("add_eos", c.add_eos);
    c.bos_token = f->get_string("bos_token", "");
    c.eos_token = f->get_string("eos_token", "");
    c.shard_tokens = f->get_int("shard_tokens", c.shard_tokens);
    POLLEN_CHECK(c.shard_tokens > 0, f->where("shard_tokens"), ": must be positive");
    c.prefix = f->get_string("prefix", c.prefix);
    // The start of the shards' file names in the output folder: a name, not a path.
    POLLEN_CHECK(!c.prefix.empty() && c.prefix.size() <= 128 && c.prefix[0] != '.' &&
                     c.prefix.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos,
                 f->where("prefix"), ": '", c.prefix.substr(0, 64),
                 "' must be a file name part of 1 to 128 characters, without '/' and not "
                 "starting with '.'");
    f->finish();
  } else {
    c.tokenize = false;
  }
  t.finish();
  return c;
}

}  // namespace

PipelineConfig PipelineConfig::load(const fs::path& path) {
  ConfigTable t = ConfigTable::load(path);
  return read_pipeline_config(t, path);
}

PipelineConfig PipelineConfig::parse(const std::string& text, const fs::path& path) {
  ConfigTable t = ConfigTable::parse(text, path.string());
  return read_pipeline_config(t, path);
}

json PipelineConfig::to_json() const {
  json j;
  j["threads_do_not_change_outputs"] = true;
  j["fail_on_bad_input"] = fail_on_bad_input;
  j["max_line_bytes"] = limits.max_line_bytes;
  j["max_doc_bytes"] = limits.max_doc_bytes;
  json srcs = json::array();
  for (const auto& s : sources)
    srcs.push_back({{"name", s.name},
                    {"paths", s.paths},
                    {"format", s.format},
                    {"delimiter", s.delimiter},
                    {"text_field", s.text_field},
                    {"id_field", s.id_field},
                    {"include", s.include},
                    {"exclude", s.exclude}});
  j["sources"] = srcs;
  j["utf8"] = {{"invalid", utf8}, {"normalize_newlines", normalize_newlines}};
  j["length"] = {{"enabled", length.enabled},
                 {"min_chars", length.min_chars},
                 {"max_chars", length.max_chars},
                 {"min_words", length.min_words},
                 {"max_words", length.max_words}};
  const auto& g = gopher_quality;
  j["gopher_quality"] = {{"enabled", g.enabled},
                         {"min_doc_words", g.min_doc_words},
                         {"max_doc_words", g.max_doc_words},
                         {"min_avg_word_length", g.min_avg_word_length},
                         {"max_avg_word_length", g.max_avg_word_length},
                         {"max_symbol_word_ratio", g.max_symbol_word_ratio},
                         {"max_bullet_lines_ratio", g.max_bullet_lines_ratio},
                         {"max_ellipsis_lines_ratio", g.max_ellipsis_lines_ratio},
                         {"max_non_alpha_words_ratio", g.max_non_alpha_words_ratio},
                         {"min_stop_words", g.min_stop_words}};
  const auto& r = gopher_repetition;
  j["gopher_repetition"] = {{"enabled", r.enabled},
                            {"dup_line_frac", r.dup_line_frac},
                            {"dup_para_frac", r.dup_para_frac},
                            {"dup_line_char_frac", r.dup_line_char_frac},
                            {"dup_para_char_frac", r.dup_para_char_frac},
                            {"top_n_grams", r.top_n_grams},
                            {"dup_n_grams", r.dup_n_grams}};
  j["c4"] = {{"enabled", c4.enabled},
             {"remove_citations", c4.remove_citations},
             {"filter_no_terminal_punct", c4.filter_no_terminal_punct},
             {"min_num_sentences", c4.min_num_sentences},
             {"min_words_per_line", c4.min_words_per_line},
             {"max_word_length", c4.max_word_length},
             {"filter_lorem_ipsum", c4.filter_lorem_ipsum},
             {"filter_javascript", c4.filter_javascript},
             {"filter_curly_bracket", c4.filter_curly_bracket},
             {"filter_policy", c4.filter_policy}};
  j["fineweb"] = {{"enabled", fineweb.enabled},
                  {"line_punct_thr", fineweb.line_punct_thr},
                  {"line_punct_exclude_zero", fineweb.line_punct_exclude_zero},
                  {"short_line_thr", fineweb.short_line_thr},
                  {"short_line_length", fineweb.short_line_length},
                  {"char_duplicates_ratio", fineweb.char_duplicates_ratio},
                  {"new_line_ratio", fineweb.new_line_ratio}};
  j["exact_dedup"] = {{"enabled", exact_dedup}};
  j["minhash"] = {{"enabled", minhash.enabled}, {"ngram", minhash.ngram},
                  {"bands", minhash.bands},     {"rows", minhash.rows},
                  {"verify", minhash.verify},   {"threshold", minhash.threshold},
                  {"seed", minhash.seed},       {"max_bucket_compare", minhash.max_bucket_compare}};
  json p{{"enabled", pii.enabled}};
  for (int k = 0; k < kPiiTypes; ++k)
    p[pii_type_name(static_cast<PiiType>(k))] = pii.types[static_cast<size_t>(k)];
  j["pii"] = p;
  j["decontaminate"] = {{"enabled", decontaminate},
                        {"ngram", decontaminate_ngram},
                        {"eval_files", eval_files},
                        {"text_field", eval_text_field}};
  j["split"] = {{"validation_fraction", validation_fraction}, {"seed", split_seed}};
  j["tokenize"] = {{"enabled", tokenize},          {"tokenizer", tokenizer},
                   {"add_bos", add_bos},           {"add_eos", add_eos},
                   {"bos_token", bos_token},       {"eos_token", eos_token},
                   {"shard_tokens", shard_tokens}, {"prefix", prefix}};
  return j;
}

}  // namespace pollen::data
