#pragma once
// The exports a recipe's export.formats asks for, written from a live model into one directory
// (export.out): what a run writes when it finishes and what `qtrain quantize` writes.
//   OUT/merged/            plain Hugging Face model (trainer/formats/merged_export.h)
//   OUT/safetensors-int/   QAT layers as integer codes + scales, the rest fp32 (safetensors_int.h)
//   OUT/model.gguf         llama.cpp's GGUF, of export.gguf_type (gguf_export.h)
//   OUT/compressed-tensors/  vLLM's and llm-compressor's format, of export.scheme (compressed_tensors.h)
// `peft` is not written here: an adapter run keeps it in RUN/adapter. Each export is staged
// beside its target and renamed into place, so a crash leaves the previous one or none. Every
// writer takes the base directory read once (base_directory.h).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qat/gguf_file_types.h"
#include "qat/quant_presets.h"
#include "trainer/formats/base_directory.h"
#include "trainer/formats/export_formats.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

// What the writers take beyond the model: the dtype of unquantized weights (merged: the base's
// config.json dtype when unset; safetensors-int: fp32, so the export evaluates exactly as the QAT
// model did) and the largest safetensors file.
struct ModelExportOptions {
  std::optional<torch::ScalarType> dtype;
  std::optional<uint64_t> max_shard_bytes;
  // gguf: llama.cpp's file type (null: auto; GgufExportOptions::file_type).
  const qat::GgufFileType* gguf_file_type = nullptr;
  // compressed-tensors: the preset (qat/quant_presets.h) its weights are written on; null: a QAT
  // run's own (qat.weights.scheme), W4A16 otherwise.
  const qat::QuantPreset* compressed_tensors_scheme = nullptr;
};

// What a format of export_formats.h does with a model, one row each.
struct ExportWriter {
  // An Error, as `write` would give it, when a model of `base` cannot be written in this format:
  // for runs to check before they train, not after. Null: nothing to check.
  void (*preflight)(const BaseDirectory& base);
  // Writes `model` to `path`: the file itself (single_file) or a fresh staging directory. Null
  // for peft, which is the adapter's own writer (peft_adapter.h).
  void (*write)(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& path,
                const ModelExportOptions& options);
};

const ExportWriter& export_writer(ExportFormat format);

// The pre-flight check of every format of `formats` (export.formats).
void check_model_exports(const BaseDirectory& base, const std::vector<std::string>& formats);

// Writes `format` (any but peft) of `model` to `out_path`: a single file written beside itself
// and renamed, a directory staged in OUT.staging and renamed.
void write_model_export(const ExportFormatRow& format, const LlamaForCausalLMImpl& model, const BaseDirectory& base,
                        const std::string& out_path, const ModelExportOptions& options = {});

// Writes every format of `formats` except peft into `out_dir` (created), each at its row's
// target, and returns the paths written.
std::vector<std::string> write_model_exports(const LlamaForCausalLMImpl& model, const BaseDirectory& base,
                                             const std::vector<std::string>& formats, const std::string& out_dir,
                                             const ModelExportOptions& options = {});

}  // namespace qtrain::trainer
