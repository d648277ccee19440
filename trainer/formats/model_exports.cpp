#include "trainer/formats/model_exports.h"

#include <cstdio>
#include <filesystem>

#include "kernels/error.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/compressed_tensors.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/safetensors_int.h"

namespace qtrain::trainer {

namespace {

// gguf's tensor types come from its file type, not from the dtype.
void write_gguf(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& path,
                const ModelExportOptions& options) {
  GgufExportOptions gguf;
  gguf.file_type = options.gguf_file_type;
  write_gguf_model(model, base, path, gguf);
}

void write_merged(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& path,
                  const ModelExportOptions& options) {
  MergedExportOptions merged;
  merged.dtype = options.dtype.value_or(base.config.stored_dtype);
  if (options.max_shard_bytes) merged.max_shard_bytes = *options.max_shard_bytes;
  write_merged_model(model, base, path, merged);
}

void write_safetensors_int(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& path,
                           const ModelExportOptions& options) {
  QuantizedExportOptions quantized;
  if (options.dtype) quantized.dtype = *options.dtype;
  if (options.max_shard_bytes) quantized.max_shard_bytes = *options.max_shard_bytes;
  write_quantized_model(model, base, path, quantized);
}

// compressed-tensors: PTQ in the base's dtype unless --dtype says otherwise.
void write_compressed_tensors(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& path,
                              const ModelExportOptions& options) {
  CompressedTensorsExportOptions compressed;
  compressed.preset = options.compressed_tensors_scheme ? options.compressed_tensors_scheme
                                                         : &qat::find_quant_preset("W4A16", "export.scheme");
  compressed.dtype = options.dtype.value_or(base.config.stored_dtype);
  if (options.max_shard_bytes) compressed.max_shard_bytes = *options.max_shard_bytes;
  const auto dense = write_compressed_tensors_model(model, base, path, compressed);
  if (!dense.empty()) {
    std::fprintf(stderr, "compressed-tensors: %zu layer(s) left dense and in `ignore`: %s's groups of %lld do not divide "
                 "their inputs (first: %s)\n", dense.size(), compressed.preset->name,
                 static_cast<long long>(compressed.preset->weights.group_size), dense.front().c_str());
  }
}

}  // namespace

// The switch has no default, and -Wswitch is an error here, so that a new format does not
// compile until its writer is named.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
const ExportWriter& export_writer(ExportFormat format) {
  static const ExportWriter peft = {nullptr, nullptr};
  static const ExportWriter merged = {nullptr, write_merged};
  static const ExportWriter gguf = {require_gguf_exportable, write_gguf};
  static const ExportWriter safetensors_int = {nullptr, write_safetensors_int};
  static const ExportWriter compressed_tensors = {nullptr, write_compressed_tensors};
  switch (format) {
    case ExportFormat::kPeft: return peft;
    case ExportFormat::kMerged: return merged;
    case ExportFormat::kGguf: return gguf;
    case ExportFormat::kSafetensorsInt: return safetensors_int;
    case ExportFormat::kCompressedTensors: return compressed_tensors;
  }
  throw Error(ErrorCode::kInternal, "export format " + std::to_string(static_cast<int>(format)) + " has no writer");
}
#pragma GCC diagnostic pop

void check_model_exports(const BaseDirectory& base, const std::vector<std::string>& formats) {
  for (const auto& name : formats) {
    const auto& writer = export_writer(find_export_format(name, "export.formats").format);
    if (writer.preflight) writer.preflight(base);
  }
}

void write_model_export(const ExportFormatRow& format, const LlamaForCausalLMImpl& model, const BaseDirectory& base,
                        const std::string& out_path, const ModelExportOptions& options) {
  const auto& writer = export_writer(format.format);
  if (!writer.write) throw Error(ErrorCode::kInternal, std::string("write_model_export: ") + format.name + " has its own writer");
  if (format.single_file) {
    writer.write(model, base, out_path, options);
    return;
  }
  const std::string staged = out_path + ".staging";
  remove_tree(staged);
  writer.write(model, base, staged, options);
  replace_directory(staged, out_path);
}

std::vector<std::string> write_model_exports(const LlamaForCausalLMImpl& model, const BaseDirectory& base,
                                             const std::vector<std::string>& formats, const std::string& out_dir,
                                             const ModelExportOptions& options) {
  std::vector<std::string> written;
  std::filesystem::create_directories(out_dir);
  for (const auto& name : formats) {
    const auto& format = find_export_format(name, "export.formats");
    if (!export_writer(format.format).write) continue;  // peft: the run's adapter directory
    const std::string target = out_dir + "/" + format.target;
    write_model_export(format, model, base, target, options);
    written.push_back(target);
  }
  return written;
}

}  // namespace qtrain::trainer
