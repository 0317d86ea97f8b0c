// `pollen export hf --model M [--adapter DIR] [--tokenizer F] --output DIR [--dtype f32|bf16|f16]
// [--max-shard-mb N]` and `pollen export gguf --model M [--adapter DIR] --output F.gguf
// [--type f32|f16|bf16|q8_0]`: wiring only; the writers are io::export_hf and io::export_gguf,
// LoRA adapters are merged by model::merge_lora.
#include <cstdio>
#include <memory>
#include <string>

#include "base/error.h"
#include "base/files.h"
#include "cli/commands.h"
#include "cli/model_args.h"
#include "io/gguf.h"
#include "io/hf.h"
#include "io/model_source.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_format.h"

namespace pollen::cli {
namespace {

// tokenizer_config.json for a tokenizer.json of pollen's, with its BOS and EOS named.
nlohmann::json hf_tokenizer_config(const tokenizer::Tokenizer& tok, const SpecialIds& ids,
                                   int64_t context) {
  const auto content = [&](const std::optional<uint32_t>& id) {
    for (const auto& t : tok.added_tokens())
      if (id && t.id == *id) return nlohmann::json(t.content);
    return nlohmann::json(nullptr);
  };
  nlohmann::json config = io::hf_tokenizer_config(context);
  config["bos_token"] = content(ids.bos);
  config["eos_token"] = content(ids.eos);
  return config;
}

void add_export_gguf(CLI::App* cmd) {
  auto* gguf = cmd->add_subcommand(
      "gguf", "Write a GGUF v3 file for llama.cpp (llama architecture, byte-level BPE tokenizer)");
  struct Args {
    std::string model, adapter, tokenizer, output, type = "f32";
  };
  auto a = std::make_shared<Args>();
  gguf->add_option("--model", a->model, kModelHelp)->required();
  gguf->add_option("--adapter", a->adapter, kAdapterHelp);
  gguf->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: the model's)");
  gguf->add_option("--output", a->output, "GGUF file to write")->required();
  gguf->add_option("--type", a->type,
                   "Matrices stored as f32, f16, bf16 or q8_0 (vectors stay f32; q8_0 falls "
                   "back to f16 for rows not a multiple of 32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0"}))
      ->capture_default_str();
  gguf->callback([a] {
    io::check_gguf_output(a->output);  // before a model is loaded
    const io::ModelSource src = io::resolve_model(a->model);
    const tokenizer::Tokenizer tok = model_tokenizer(src, a->tokenizer);
    check_tokenizer_fits(tok, src, a->tokenizer);  // before the weights load
    const model::Llama m = load_model_with_adapter(src, a->adapter);
    io::GgufExportOptions o;
    o.type = io::gguf_type_named(a->type);
    const SpecialIds ids = special_ids(src, tok);
    o.bos_token_id = ids.bos;
    o.eos_token_id = ids.eos;
    o.chat_template = io::model_chat_template(src, a->tokenizer);
    const io::GgufExportResult r = io::export_gguf(m, tok, a->output, o);
    std::printf("exported %s '%s' to %s: %zu tensors (%s), %.1f MB, pre-tokenizer %s%s\n",
                io::model_kind_name(src.kind), a->model.c_str(), a->output.c_str(), r.tensors,
                a->type.c_str(), static_cast<double>(r.bytes) / 1e6, r.pre_tokenizer.c_str(),
                o.chat_template ? ", with its chat template" : "");
  });
}

}  // namespace

void add_export_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("export", "Write a model in another ecosystem's format");
  cmd->require_subcommand(1);
  auto* hf = cmd->add_subcommand(
      "hf",
      "Write an HF directory: config.json, model.safetensors (sharded with an index "
      "above --max-shard-mb) and the tokenizer files when the model has them");
  auto model = std::make_shared<std::string>();
  auto adapter = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  auto dtype = std::make_shared<std::string>("f32");
  auto shard_mb = std::make_shared<uint64_t>(5000);
  auto tokenizer_file = std::make_shared<std::string>();
  hf->add_option("--model", *model,
                 "Preset, model file (.toml), pollen checkpoint or run folder, or HF directory")
      ->required();
  hf->add_option("--adapter", *adapter, kAdapterHelp);
  hf->add_option("--tokenizer", *tokenizer_file,
                 "tokenizer.json to export with a model that has none (a federated server's "
                 "global model)");
  hf->add_option("--output", *output,
                 "Folder to write: a new or empty one, or one an earlier export wrote, which is "
                 "replaced whole (a folder holding other files is refused)")
      ->required();
  hf->add_option("--dtype", *dtype, "Stored dtype: f32, bf16 or f16")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  hf->add_option("--max-shard-mb", *shard_mb, "Largest shard in MB (10^6 bytes)")
      ->check(one_or_more())
      ->capture_default_str();
  hf->callback([=] {
    const io::ModelSource src = io::resolve_model(*model);
    // Its tokenizer files (and the special ids they name) would be copied beside another one.
    POLLEN_CHECK(tokenizer_file->empty() || !src.tokenizer, "--tokenizer: model '", *model,
                 "' has its own tokenizer ('", src.tokenizer.value_or("").string(),
                 "'); --tokenizer is for a model that knows none");
    const std::optional<std::filesystem::path> tokenizer_path =
        tokenizer_file->empty() ? src.tokenizer : std::filesystem::path(*tokenizer_file);
    std::optional<tokenizer::Tokenizer> loaded;
    if (tokenizer_path) loaded.emplace(model_tokenizer(src, *tokenizer_file));
    // Its ids must fit the model's vocabulary: checked before the weights are loaded.
    if (!tokenizer_file->empty()) check_tokenizer_fits(*loaded, src, *tokenizer_file);
    const model::Llama m = load_model_with_adapter(src, *adapter);
    io::HfExportOptions o;
    o.dtype = *dtype == "bf16" ? DType::bf16 : *dtype == "f16" ? DType::f16 : DType::f32;
    o.max_shard_bytes = *shard_mb * 1'000'000ull;
    for (const auto& f : src.hf_side_files) o.extra_files.push_back(f);
    if (loaded) {
      const tokenizer::Tokenizer& tok = *loaded;
      // As it is, under the name transformers looks for, whatever the run called it.
      o.tokenizer_json = read_file(*tokenizer_path);
      const SpecialIds ids = special_ids(src, tok);
      o.bos_token_id = ids.bos;
      o.eos_token_id = ids.eos;
      o.generation_eos_ids = ids.ends;
      o.tokenizer_config = hf_tokenizer_config(tok, ids, m.config().max_position_embeddings);
      // A chat-trained checkpoint's template goes with it, so that transformers'
      // apply_chat_template (and pollen chat on the export) render the turns it learned.
      if (src.chat_template)
        o.tokenizer_config["chat_template"] = std::string(
            tokenizer::chat_template_jinja(tokenizer::chat_template_named(*src.chat_template)));
    }
    const io::HfExportResult r = io::export_hf(m, *output, o);
    std::printf("exported %s '%s' to %s: %zu files, %.1f MB of weights%s\n",
                io::model_kind_name(src.kind), model->c_str(), output->c_str(), r.files.size(),
                static_cast<double>(r.weight_bytes) / 1e6,
                tokenizer_path ? "" : " (no tokenizer known for this model: --tokenizer adds one)");
  });
  add_export_gguf(cmd);
}

}  // namespace pollen::cli
