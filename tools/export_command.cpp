// qtrain export: what a run trained, in a format other tools load.
//   --format peft    the run's LoRA adapter as a PEFT adapter directory
//   --format merged  the base with the adapter merged in, as a plain Hugging Face model directory
//   --format gguf    the model as one GGUF file llama.cpp runs, of --gguf-type (llama.cpp's file
//                    types; a QAT run's trained blocks as they are)
//   --format safetensors-int  a QAT run's model with integer weights + scales (+ zero points)
//   --format compressed-tensors  the model on a compressed-tensors preset (--scheme) for vLLM /
//                    SGLang / transformers (a QAT run's trained codes as they are)
// A run's model (--run) or a model directory with an optional adapter (--model, --adapter; merged
// and gguf). The result is staged beside --out and renamed into place.
#include <cstdio>
#include <filesystem>

#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/formats/hf_hub_cache.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/model_exports.h"
#include "qat/qat_linear.h"
#include "qat/quant_presets.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/trained_run.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

struct ExportSource {
  trainer::LoadedModel loaded;
  std::string base_dir;        // the Hugging Face directory of the base (config, tokenizer)
  std::string description;     // for the closing message
};

// "peft (the LoRA adapter), merged (...), gguf (...) or safetensors-int (...)" and
// "peft|merged|gguf|safetensors-int", from the rows.
std::string format_choices() {
  const auto& rows = trainer::export_formats();
  std::string text;
  for (size_t index = 0; index < rows.size(); ++index) {
    text += std::string(index == 0 ? "" : index + 1 == rows.size() ? " or " : ", ") + rows[index].name + " (" +
            rows[index].description + ")";
  }
  return text;
}

std::string format_names() {
  std::string text;
  for (const auto& name : trainer::export_format_names()) text += (text.empty() ? "" : "|") + name;
  return text;
}

// --model DIR [--adapter DIR]: the model in fp32 (a bnb 4-bit directory keeps its 4-bit layers,
// dequantized by the merge), the adapter applied.
ExportSource model_with_adapter(const std::string& model_dir, const std::string& adapter_dir) {
  ExportSource source;
  source.loaded = trainer::load_llama(model_dir);
  if (!adapter_dir.empty()) trainer::apply_peft_adapter(*source.loaded.model, adapter_dir);
  source.base_dir = model_dir;
  source.description = model_dir + (adapter_dir.empty() ? "" : " with " + adapter_dir);
  return source;
}

// --format safetensors-int: the QAT layers of the run, as their codes and scales.
int export_quantized(const std::string& run_dir, const std::string& checkpoint, const trainer::ExportFormatRow& format,
                     const std::string& dtype_name, uint64_t max_shard_bytes, const std::string& out_path) {
  auto run = trainer::load_trained_run(run_dir, checkpoint, /*quantize_base=*/true);
  const auto& model = *run.loaded.model;
  if (qat::find_qat_layers(model).empty()) {
    throw Error(ErrorCode::kUsage, run_dir + ": the run was not trained with quant: qat, so it has no quantized weights to export as " +
                format.name + " (use --format merged or peft)");
  }
  trainer::ModelExportOptions options;
  options.dtype = dtype_name == "base" ? run.loaded.config.stored_dtype : trainer::parse_dtype_name(dtype_name, "--dtype");
  options.max_shard_bytes = max_shard_bytes;
  trainer::write_model_export(format, model, trainer::BaseDirectory::read(run.recipe.model.path, run.loaded.config), out_path,
                              options);
  std::printf("export: QAT model of %s written as %s to %s\n", run_dir.c_str(), format.name, out_path.c_str());
  return 0;
}

}  // namespace

int run_export(const Arguments& arguments) {
  std::string run_dir, model_dir, adapter_dir, format, out_dir, checkpoint, dtype_name, shard_size, gguf_type, scheme;
  po::options_description options("export options");
  options.add_options()
      ("run", po::value(&run_dir)->default_value(""), "run directory (train.output_dir of a run)")
      ("checkpoint", po::value(&checkpoint)->default_value(""),
       "a training-state checkpoint of the run (step-000500) instead of its final adapter")
      ("model", po::value(&model_dir)->default_value(""),
       "merged and gguf, instead of --run: a Hugging Face model directory (bf16/fp32 or bnb 4-bit)")
      ("adapter", po::value(&adapter_dir)->default_value(""), "with --model: a PEFT LoRA adapter to merge")
      ("format", po::value(&format)->default_value("peft"), format_choices().c_str())
      ("gguf-type", po::value(&gguf_type)->default_value(qat::kGgufFileTypeAuto),
       ("gguf: llama.cpp's file type, " + qat::gguf_file_type_names() +
        " (quantized types: the bytes llama-quantize writes from the F32 file); auto = a QAT run's trained blocks, "
        "the rest F32").c_str())
      ("scheme", po::value(&scheme)->default_value("auto"),
       ("compressed-tensors: the preset, " + [] {
         std::string names;
         for (const auto& name : qat::quant_preset_names()) names += (names.empty() ? "" : ", ") + name;
         return names;
       }() + "; auto = a QAT run's qat.weights.scheme, W4A16 otherwise").c_str())
      ("dtype", po::value(&dtype_name)->default_value("base"),
       "merged, safetensors-int, compressed-tensors: dtype of the unquantized weights, bf16, fp16 or fp32; base = the base model's "
       "config.json dtype")
      ("shard-size", po::value(&shard_size)->default_value("5GB"),
       "merged: largest safetensors file (5GB, 500MB, 2GiB); more weights are sharded with an index")
      ("out", po::value(&out_dir)->required(), "directory to write (gguf: the .gguf file); must not exist unless --force")
      ("force", po::bool_switch(), "replace an existing --out directory");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain export --run DIR [--checkpoint step-N] --format " + format_names() +
                          " [--gguf-type T] [--scheme S] --out PATH [--force]\n"
                          "       qtrain export --model DIR [--adapter DIR] --format merged|gguf|compressed-tensors [--gguf-type T] "
                          "[--scheme S] --out PATH [--force]",
                          options, arguments, values)) {
    return 0;
  }
  model_dir = trainer::resolve_model_path(model_dir, "--model");  // a folder, or ORG/NAME in the HF cache
  const auto& export_format = trainer::find_export_format(format, "--format");
  const bool quantized_format = !export_format.accepts(trainer::ExportedWeights::kFloat);
  if (run_dir.empty() == model_dir.empty()) throw Error(ErrorCode::kUsage, "give either --run DIR or --model DIR (not both)");
  const bool gguf_format = export_format.format == trainer::ExportFormat::kGguf;
  const bool peft_format = export_format.format == trainer::ExportFormat::kPeft;
  if (!model_dir.empty() && (peft_format || quantized_format)) {
    throw Error(ErrorCode::kUsage, std::string("--model exports --format merged, gguf or compressed-tensors, not ") + export_format.name +
                " (a PEFT adapter is already its own export; " +
                trainer::export_formats_refusing(trainer::ExportedWeights::kFloat) + " take a QAT run, --run DIR)");
  }
  if (!adapter_dir.empty() && model_dir.empty()) throw Error(ErrorCode::kUsage, "--adapter goes with --model; a run's adapter is found from --run");
  if (!checkpoint.empty() && run_dir.empty()) throw Error(ErrorCode::kUsage, "--checkpoint goes with --run");
  if (gguf_type != qat::kGgufFileTypeAuto && !gguf_format) {
    throw Error(ErrorCode::kUsage, "--gguf-type goes with --format gguf");
  }
  const bool compressed_format = export_format.format == trainer::ExportFormat::kCompressedTensors;
  if (scheme != "auto" && !compressed_format) throw Error(ErrorCode::kUsage, "--scheme goes with --format compressed-tensors");
  if (scheme != "auto") qat::find_quant_preset(scheme, "--scheme");
  trainer::ModelExportOptions export_options;
  export_options.max_shard_bytes = trainer::parse_byte_size(shard_size, "--shard-size");
  export_options.gguf_file_type = trainer::parse_gguf_type(gguf_type, "--gguf-type");
  const bool force = values["force"].as<bool>();
  if (std::filesystem::exists(out_dir) && !force) {
    throw Error(ErrorCode::kUsage, out_dir + ": already exists; choose another --out or pass --force to replace it");
  }
  if (quantized_format) {
    return export_quantized(run_dir, checkpoint, export_format, dtype_name, *export_options.max_shard_bytes, out_dir);
  }

  ExportSource source;
  if (!run_dir.empty()) {
    // A merge or a GGUF needs the base the adapter was trained on (quantized, for QLoRA; QAT
    // layers, for QAT); a PEFT export only checks the adapter against the base's names and shapes.
    auto run = trainer::load_trained_run(run_dir, checkpoint, /*quantize_base=*/!peft_format);
    if (peft_format) {
      const std::string staged = out_dir + ".staging";
      trainer::remove_tree(staged);
      trainer::write_peft_adapter(*run.loaded.model, run.adapter, staged, run.recipe.model.path);
      trainer::replace_directory(staged, out_dir);
      std::printf("export: PEFT adapter of %s written to %s\n", run_dir.c_str(), out_dir.c_str());
      return 0;
    }
    if (gguf_format && gguf_type == qat::kGgufFileTypeAuto) {
      // auto: the file type a run that trained on GGUF blocks trained on.
      auto recipe = run.recipe;
      recipe.export_.gguf_type = qat::kGgufFileTypeAuto;
      gguf_type = trainer::gguf_export_type(recipe);
      export_options.gguf_file_type = trainer::parse_gguf_type(gguf_type, "--gguf-type");
    }
    if (compressed_format) {
      // auto: the preset a QAT run trained on.
      auto recipe = run.recipe;
      recipe.export_.scheme = scheme;
      export_options.compressed_tensors_scheme = &trainer::compressed_tensors_export_scheme(recipe);
    }
    source.loaded = std::move(run.loaded);
    source.base_dir = run.recipe.model.path;
    source.description = run.recipe.model.path + " with the adapter of " + run.adapter_source;
  } else {
    source = model_with_adapter(model_dir, adapter_dir);
    if (compressed_format) export_options.compressed_tensors_scheme = &qat::find_quant_preset(scheme == "auto" ? "W4A16" : scheme, "--scheme");
  }
  export_options.dtype = dtype_name == "base" ? source.loaded.config.stored_dtype
                                              : trainer::parse_dtype_name(dtype_name, "--dtype");
  trainer::write_model_export(export_format, *source.loaded.model,
                              trainer::BaseDirectory::read(source.base_dir, source.loaded.config), out_dir, export_options);
  if (gguf_format) {
    std::printf("export: %s written as a GGUF file (%s) to %s\n", source.description.c_str(), gguf_type.c_str(), out_dir.c_str());
  } else if (compressed_format) {
    std::printf("export: %s written as a compressed-tensors %s checkpoint (%s elsewhere) in %s\n", source.description.c_str(),
                export_options.compressed_tensors_scheme->name, trainer::dtype_short_name(*export_options.dtype).c_str(),
                out_dir.c_str());
  } else {
    std::printf("export: %s merged into a %s Hugging Face model in %s\n", source.description.c_str(),
                trainer::dtype_short_name(*export_options.dtype).c_str(), out_dir.c_str());
  }
  return 0;
}

}  // namespace qtrain::tools
