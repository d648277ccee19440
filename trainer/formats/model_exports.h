#pragma once
// The exports a recipe's export.formats asks for, written from a live model into one directory
// (export.out): what a run writes when it finishes and what `qtrain quantize` writes.
//   OUT/merged/            plain Hugging Face model (trainer/formats/merged_export.h)
//   OUT/safetensors-int/   QAT layers as integer codes + scales, the rest fp32 (safetensors_int.h)
//   OUT/model.gguf         llama.cpp's GGUF with Q4_0 / Q8_0 QAT layers (gguf_export.h)
// `peft` is not written here: an adapter run keeps it in RUN/adapter. Each export is staged
// beside its target and renamed into place, so a crash leaves the previous one or none.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trainer/formats/export_formats.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

// What the writers take beyond the model: the dtype of unquantized weights (merged: the base's
// config.json dtype when unset; safetensors-int: fp32, so the export evaluates exactly as the QAT
// model did; gguf writes F32) and the largest safetensors file.
struct ModelExportOptions {
  std::optional<torch::ScalarType> dtype;
  std::optional<uint64_t> max_shard_bytes;
};

// Writes `format` (any but peft, which is the adapter's own writer) of `model` to `out_path`:
// gguf's file written beside itself and renamed, the others staged in OUT.staging and renamed.
// `base_dir` supplies the tokenizer and generation config.
void write_model_export(const ExportFormatRow& format, const LlamaForCausalLMImpl& model, const HfModelConfig& config,
                        const std::string& base_dir, const std::string& out_path, const ModelExportOptions& options = {});

// Writes every format of `formats` except peft into `out_dir` (created), each at its row's
// target, and returns the paths written.
std::vector<std::string> write_model_exports(const LlamaForCausalLMImpl& model, const HfModelConfig& config,
                                             const std::string& base_dir, const std::vector<std::string>& formats,
                                             const std::string& out_dir);

}  // namespace qtrain::trainer
