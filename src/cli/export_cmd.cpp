// `pollen export hf --model M --output DIR [--dtype f32|bf16|f16] [--max-shard-mb N]`: wiring
// only; the writer is io::export_hf.
#include <cstdio>
#include <memory>
#include <string>

#include "base/error.h"
#include "cli/commands.h"
#include "io/hf.h"
#include "io/model_source.h"

namespace pollen::cli {

void add_export_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("export", "Write a model in another ecosystem's format");
  cmd->require_subcommand(1);
  auto* hf = cmd->add_subcommand(
      "hf",
      "Write an HF directory: config.json, model.safetensors (sharded with an index "
      "above --max-shard-mb) and the tokenizer files when the model has them");
  auto model = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  auto dtype = std::make_shared<std::string>("f32");
  auto shard_mb = std::make_shared<uint64_t>(5000);
  hf->add_option("--model", *model,
                 "Preset, model file (.toml), pollen checkpoint or run folder, or HF directory")
      ->required();
  hf->add_option("--output", *output, "Folder to write")->required();
  hf->add_option("--dtype", *dtype, "Stored dtype: f32, bf16 or f16")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  hf->add_option("--max-shard-mb", *shard_mb, "Largest shard in MB (10^6 bytes)")
      ->check(CLI::PositiveNumber);
  hf->callback([=] {
    const io::ModelSource src = io::resolve_model(*model);
    const model::Llama m = io::load_model(src);
    io::HfExportOptions o;
    o.dtype = *dtype == "bf16" ? DType::bf16 : *dtype == "f16" ? DType::f16 : DType::f32;
    o.max_shard_bytes = *shard_mb * 1'000'000ull;
    if (src.tokenizer) o.extra_files.push_back(*src.tokenizer);
    for (const auto& f : src.hf_side_files) o.extra_files.push_back(f);
    const io::HfExportResult r = io::export_hf(m, *output, o);
    std::printf("exported %s '%s' to %s: %zu files, %.1f MB of weights%s\n",
                io::model_kind_name(src.kind), model->c_str(), output->c_str(), r.files.size(),
                static_cast<double>(r.weight_bytes) / 1e6,
                src.tokenizer ? "" : " (no tokenizer known for this model)");
  });
}

}  // namespace pollen::cli
