#pragma once
// The one exception type qtrain throws. Its text is a message to a user: it names the file,
// key or tensor, says what was expected and what to do. The CLI prints it with its code
// ("error [QT-WEIGHTS]: ...") and exits with 2; docs/ERRORS.md says what each code means.
// Free of LibTorch, so that the file parsers can be built alone (the fuzz targets are).
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

namespace qtrain {

// What went wrong, as a stable name a user can look up in docs/ERRORS.md. Names are data:
// error_code_name() is the one table; never renumber or rename a code that shipped.
enum class ErrorCode {
  kUsage,           // QT-USAGE: the command line
  kRecipe,          // QT-RECIPE: recipe YAML or a --set override
  kModelConfig,     // QT-CONFIG: config.json, generation_config.json
  kTokenizer,       // QT-TOKENIZER: tokenizer.json, tokenizer_config.json, chat templates
  kData,            // QT-DATA: JSONL / text datasets, llm.c .bin token files
  kWeights,         // QT-WEIGHTS: safetensors files and model weights
  kAdapter,         // QT-ADAPTER: PEFT adapter directories
  kCheckpoint,      // QT-CHECKPOINT: training checkpoints (save, resume)
  kFileSystem,      // QT-IO: reading or writing files (disk full, permissions, quota)
  kDistributed,     // QT-DISTRIBUTED: torchrun's environment, process groups
  kNumerics,        // QT-NUMERICS: non-finite loss or gradients
  kOutOfMemory,     // QT-OUT-OF-MEMORY: host or GPU memory exhausted
  kInternal,        // QT-INTERNAL: an unexpected library failure (a bug to report)
};

inline const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kUsage: return "QT-USAGE";
    case ErrorCode::kRecipe: return "QT-RECIPE";
    case ErrorCode::kModelConfig: return "QT-CONFIG";
    case ErrorCode::kTokenizer: return "QT-TOKENIZER";
    case ErrorCode::kData: return "QT-DATA";
    case ErrorCode::kWeights: return "QT-WEIGHTS";
    case ErrorCode::kAdapter: return "QT-ADAPTER";
    case ErrorCode::kCheckpoint: return "QT-CHECKPOINT";
    case ErrorCode::kFileSystem: return "QT-IO";
    case ErrorCode::kDistributed: return "QT-DISTRIBUTED";
    case ErrorCode::kNumerics: return "QT-NUMERICS";
    case ErrorCode::kOutOfMemory: return "QT-OUT-OF-MEMORY";
    case ErrorCode::kInternal: return "QT-INTERNAL";
  }
  return "QT-INTERNAL";
}

class Error : public std::runtime_error {
 public:
  // Every throw site names its code: a user looks the code up in docs/ERRORS.md.
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// "[8192, 256]": a tensor shape as error messages write it (and as c10 prints sizes()).
template <typename Shape>
std::string shape_text(const Shape& shape) {
  std::ostringstream text;
  text << "[";
  bool first = true;
  for (const auto extent : shape) {
    text << (first ? "" : ", ") << extent;
    first = false;
  }
  text << "]";
  return text.str();
}
inline std::string shape_text(std::initializer_list<int64_t> shape) {
  return shape_text<std::initializer_list<int64_t>>(shape);
}

}  // namespace qtrain
