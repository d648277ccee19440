#pragma once
// The formats a model is exported in, one row each: the name export.formats and
// `qtrain export --format` use, where it goes, and what it needs. The end of a run
// (formats/model_exports.h), `qtrain export`, `qtrain quantize` and the recipe's key table read
// this one table. Plain data, free of LibTorch.
#include <string>
#include <vector>

#include "kernels/error.h"

namespace qtrain::trainer {

enum class ExportFormat { kPeft, kMerged, kGguf, kSafetensorsInt };

struct ExportFormatRow {
  ExportFormat format;
  const char* name;       // export.formats / --format
  const char* target;     // under export.out: a directory, or gguf's one file
  bool single_file;       // written beside itself and renamed (gguf); the others stage a directory
  bool needs_qat_layers;  // the weights on a QAT run's grid (gguf, safetensors-int)
};

inline const std::vector<ExportFormatRow>& export_formats() {
  static const std::vector<ExportFormatRow> rows = {
      {ExportFormat::kPeft, "peft", "adapter", false, false},
      {ExportFormat::kMerged, "merged", "merged", false, false},
      {ExportFormat::kGguf, "gguf", "model.gguf", true, true},
      {ExportFormat::kSafetensorsInt, "safetensors-int", "safetensors-int", false, true},
  };
  return rows;
}

inline std::vector<std::string> export_format_names() {
  std::vector<std::string> names;
  for (const auto& row : export_formats()) names.emplace_back(row.name);
  return names;
}

// The row named `name`; an error naming `key` (export.formats, --format) and the formats.
inline const ExportFormatRow& find_export_format(const std::string& name, const std::string& key) {
  std::string known;
  for (const auto& row : export_formats()) {
    if (name == row.name) return row;
    known += (known.empty() ? "" : ", ") + std::string(row.name);
  }
  throw Error(ErrorCode::kUsage, key + ": unknown format '" + name + "' (" + known + ")");
}

}  // namespace qtrain::trainer
