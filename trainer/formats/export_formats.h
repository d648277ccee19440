#pragma once
// The formats a model is exported in, one row each: the name export.formats and `qtrain export
// --format` use, where it goes under export.out, and which weights it can hold. The recipe's
// checks, `qtrain export`, `qtrain quantize` and the end of a run read this one table. It is free
// of LibTorch, because the recipe (and its fuzz target) reads it; what needs the model, each
// format's pre-flight check and writer, is its row of formats/model_exports.h (export_writer).
// A new format is one enumerator, one row here and one writer there.
#include <string>
#include <vector>

namespace qtrain::trainer {

enum class ExportFormat { kPeft, kMerged, kGguf, kSafetensorsInt, kCompressedTensors };

// What a run's weights are when it is exported: dense float weights (LoRA merged in, or trained
// in full), or QAT layers, whose integer codes and scales a format may store as they are.
enum class ExportedWeights { kFloat, kQatCodes };

struct ExportFormatRow {
  ExportFormat format;
  const char* name;         // export.formats / --format
  const char* target;       // under export.out: a directory, or gguf's one file
  const char* description;  // for `qtrain export --help`
  bool single_file;         // written beside itself and renamed (gguf); the others stage a directory
  // Whether the format can hold a model whose weights are `weights` (safetensors-int writes QAT
  // codes, which a float model does not have; gguf quantizes a float model itself).
  bool (*accepts)(ExportedWeights weights);
};

const std::vector<ExportFormatRow>& export_formats();
std::vector<std::string> export_format_names();

// The row named `name`; an error naming `key` (export.formats, --format) and the formats.
const ExportFormatRow& find_export_format(const std::string& name, const std::string& key);

// The names of the formats that cannot hold `weights`, for messages: "gguf and safetensors-int".
std::string export_formats_refusing(ExportedWeights weights);

}  // namespace qtrain::trainer
