#include "trainer/formats/model_exports.h"

#include <filesystem>

#include "kernels/error.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/safetensors_int.h"

namespace qtrain::trainer {

std::vector<std::string> write_model_exports(const LlamaForCausalLMImpl& model, const HfModelConfig& config,
                                             const std::string& base_dir, const std::vector<std::string>& formats,
                                             const std::string& out_dir) {
  std::vector<std::string> written;
  std::filesystem::create_directories(out_dir);
  for (const auto& format : formats) {
    if (format == "peft") continue;
    if (format == "gguf") {
      // One file, written to a temporary beside it and renamed.
      const std::string target = out_dir + "/model.gguf";
      write_gguf_model(model, config, base_dir, target);
      written.push_back(target);
      continue;
    }
    const std::string target = out_dir + "/" + format;
    const std::string staged = out_dir + "/." + format + ".staging";
    remove_tree(staged);
    if (format == "merged") {
      MergedExportOptions options;
      options.dtype = config.stored_dtype;
      write_merged_model(model, config, base_dir, staged, options);
    } else if (format == "safetensors-int") {
      // fp32 for what is not quantized, so the export evaluates exactly as the QAT model did.
      write_quantized_model(model, config, base_dir, staged, QuantizedExportOptions{});
    } else {
      throw Error(ErrorCode::kRecipe, "export.formats: unknown format '" + format + "' (peft, merged, gguf or safetensors-int)");
    }
    replace_directory(staged, target);
    written.push_back(target);
  }
  return written;
}

}  // namespace qtrain::trainer
