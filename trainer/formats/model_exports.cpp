#include "trainer/formats/model_exports.h"

#include <filesystem>

#include "kernels/error.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/safetensors_int.h"

namespace qtrain::trainer {

void write_model_export(const ExportFormatRow& format, const LlamaForCausalLMImpl& model, const HfModelConfig& config,
                        const std::string& base_dir, const std::string& out_path, const ModelExportOptions& options) {
  if (format.single_file) {
    write_gguf_model(model, config, base_dir, out_path);
    return;
  }
  const std::string staged = out_path + ".staging";
  remove_tree(staged);
  switch (format.format) {
    case ExportFormat::kMerged: {
      MergedExportOptions merged;
      merged.dtype = options.dtype.value_or(config.stored_dtype);
      if (options.max_shard_bytes) merged.max_shard_bytes = *options.max_shard_bytes;
      write_merged_model(model, config, base_dir, staged, merged);
      break;
    }
    case ExportFormat::kSafetensorsInt: {
      QuantizedExportOptions quantized;
      if (options.dtype) quantized.dtype = *options.dtype;
      if (options.max_shard_bytes) quantized.max_shard_bytes = *options.max_shard_bytes;
      write_quantized_model(model, config, base_dir, staged, quantized);
      break;
    }
    default:
      throw Error(ErrorCode::kInternal, std::string("write_model_export: ") + format.name + " has its own writer");
  }
  replace_directory(staged, out_path);
}

std::vector<std::string> write_model_exports(const LlamaForCausalLMImpl& model, const HfModelConfig& config,
                                             const std::string& base_dir, const std::vector<std::string>& formats,
                                             const std::string& out_dir) {
  std::vector<std::string> written;
  std::filesystem::create_directories(out_dir);
  for (const auto& name : formats) {
    const auto& format = find_export_format(name, "export.formats");
    if (format.format == ExportFormat::kPeft) continue;  // the run's adapter directory
    const std::string target = out_dir + "/" + format.target;
    write_model_export(format, model, config, base_dir, target);
    written.push_back(target);
  }
  return written;
}

}  // namespace qtrain::trainer
