#include "trainer/formats/export_formats.h"

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

bool any_weights(ExportedWeights) { return true; }
bool qat_codes_only(ExportedWeights weights) { return weights == ExportedWeights::kQatCodes; }

}  // namespace

const std::vector<ExportFormatRow>& export_formats() {
  static const std::vector<ExportFormatRow> rows = {
      {ExportFormat::kPeft, "peft", "adapter", "the LoRA adapter", false, any_weights},
      {ExportFormat::kMerged, "merged", "merged", "a Hugging Face model with the adapter merged in", false, any_weights},
      {ExportFormat::kGguf, "gguf", "model.gguf",
       "one llama.cpp file of --gguf-type (a QAT run's trained blocks as they are): --out is the .gguf file", true,
       any_weights},
      {ExportFormat::kSafetensorsInt, "safetensors-int", "safetensors-int", "a QAT run's integer weights + scales", false,
       qat_codes_only},
      {ExportFormat::kCompressedTensors, "compressed-tensors", "compressed-tensors",
       "what vLLM, SGLang and transformers load quantized, on --scheme (a QAT run's trained codes as they are)", false,
       any_weights},
  };
  return rows;
}

std::vector<std::string> export_format_names() {
  std::vector<std::string> names;
  for (const auto& row : export_formats()) names.emplace_back(row.name);
  return names;
}

const ExportFormatRow& find_export_format(const std::string& name, const std::string& key) {
  std::string known;
  for (const auto& row : export_formats()) {
    if (name == row.name) return row;
    known += (known.empty() ? "" : ", ") + std::string(row.name);
  }
  throw Error(ErrorCode::kUsage, key + ": unknown format '" + name + "' (" + known + ")");
}

std::string export_formats_refusing(ExportedWeights weights) {
  std::vector<std::string> names;
  for (const auto& row : export_formats()) {
    if (!row.accepts(weights)) names.emplace_back(row.name);
  }
  std::string text;
  for (size_t index = 0; index < names.size(); ++index) {
    text += (index == 0 ? "" : index + 1 == names.size() ? " and " : ", ") + names[index];
  }
  return text;
}

}  // namespace qtrain::trainer
