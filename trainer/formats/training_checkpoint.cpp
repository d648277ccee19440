#include "trainer/formats/training_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "kernels/error.h"
#include "trainer/base/checksum.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace fs = std::filesystem;

namespace {

const char* const kFiles[] = {"trainable.safetensors", "optimizer.safetensors", "random.safetensors", "state.json",
                              "recipe.yaml"};

std::string checkpoints_dir(const std::string& run_dir) { return run_dir + "/checkpoints"; }

NamedTensorList read_tensors(const std::string& path) {
  const auto file = SafetensorsFile::open(path);
  NamedTensorList tensors;
  for (const auto& name : file.names()) tensors.emplace_back(name, file.tensor(name).clone());
  return tensors;
}

std::string read_text(const std::string& path) {
  std::ifstream input(path, std::ios::binary);
  if (!input) throw Error(ErrorCode::kCheckpoint, path + ": cannot open");
  return std::string(std::istreambuf_iterator<char>(input), std::istreambuf_iterator<char>());
}

int64_t step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return -1;
  try {
    return std::stoll(name.substr(5));
  } catch (...) {
    return -1;
  }
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%06lld", static_cast<long long>(step));
  return name;
}

void load_trainable_tensors(torch::nn::Module& model, const NamedTensorList& tensors, size_t expected_count,
                            const std::string& source) {
  if (tensors.size() != expected_count) {
    throw Error(ErrorCode::kCheckpoint, source + ": holds " + std::to_string(tensors.size()) + " trainable tensors, this run has " +
                std::to_string(expected_count) + " (other lora.rank or lora.target_modules?)");
  }
  auto parameters = model.named_parameters();
  auto buffers = model.named_buffers();
  torch::NoGradGuard no_grad;
  for (const auto& [name, tensor] : tensors) {
    auto* target = parameters.find(name);
    if (target == nullptr) target = buffers.find(name);
    if (target == nullptr) {
      throw Error(ErrorCode::kCheckpoint, source + ": trainable tensor '" + name + "' has no parameter in this model (other model or targets?)");
    }
    if (target->sizes() != tensor.sizes()) {
      throw Error(ErrorCode::kCheckpoint, source + ": trainable tensor '" + name + "' is " + shape_text(tensor.sizes()) + ", this model's is " +
                  shape_text(target->sizes()) + " (other model or LoRA shape?)");
    }
    target->copy_(tensor);
  }
}

std::string write_training_checkpoint(const std::string& run_dir, int64_t step, const TrainingCheckpoint& checkpoint) {
  const std::string parent = checkpoints_dir(run_dir);
  const std::string target = parent + "/" + checkpoint_name(step);
  const std::string staged = parent + "/." + checkpoint_name(step) + ".staging";
  fs::create_directories(parent);
  remove_tree(staged);
  fs::create_directories(staged);
  write_safetensors(staged + "/trainable.safetensors", checkpoint.trainable);
  write_safetensors(staged + "/optimizer.safetensors", checkpoint.optimizer);
  write_safetensors(staged + "/random.safetensors", checkpoint.random_states);
  write_file_atomically(staged + "/state.json", checkpoint.state.dump(2) + "\n");
  write_file_atomically(staged + "/recipe.yaml", checkpoint.recipe_yaml);
  nlohmann::json manifest = {{"format", "qtrain-checkpoint-1"}, {"step", step}, {"files", nlohmann::json::object()}};
  for (const char* file : kFiles) {
    const std::string path = staged + "/" + file;
    manifest["files"][file] = {{"bytes", fs::file_size(path)}, {"crc32c", file_crc32c(path)}};
  }
  write_file_atomically(staged + "/manifest.json", manifest.dump(2) + "\n");
  replace_directory(staged, target);
  return target;
}

void verify_training_checkpoint(const std::string& directory) {
  const std::string manifest_path = directory + "/manifest.json";
  if (!fs::exists(manifest_path)) throw Error(ErrorCode::kCheckpoint, directory + ": no manifest.json (an incomplete checkpoint)");
  const auto manifest = nlohmann::json::parse(read_text(manifest_path), nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.contains("files") || !manifest["files"].is_object()) {
    throw Error(ErrorCode::kCheckpoint, manifest_path + ": not a checkpoint manifest");
  }
  for (const char* file : kFiles) {
    const auto entry = manifest["files"].find(file);
    const std::string path = directory + "/" + file;
    if (entry == manifest["files"].end() || !entry->contains("bytes") || !entry->contains("crc32c")) {
      throw Error(ErrorCode::kCheckpoint, manifest_path + ": lists no size and checksum for " + file);
    }
    std::error_code error;
    const auto bytes = fs::file_size(path, error);
    if (error) throw Error(ErrorCode::kCheckpoint, path + ": missing from the checkpoint");
    if (bytes != (*entry)["bytes"].get<uint64_t>()) {
      throw Error(ErrorCode::kCheckpoint, path + ": " + std::to_string(bytes) + " bytes, the manifest says " +
                  std::to_string((*entry)["bytes"].get<uint64_t>()) + " (damaged or truncated)");
    }
    if (file_crc32c(path) != (*entry)["crc32c"].get<std::string>()) {
      throw Error(ErrorCode::kCheckpoint, path + ": checksum differs from the manifest's (the file is damaged)");
    }
  }
}

TrainingCheckpoint read_training_checkpoint(const std::string& directory) {
  verify_training_checkpoint(directory);
  TrainingCheckpoint checkpoint;
  checkpoint.trainable = read_tensors(directory + "/trainable.safetensors");
  checkpoint.optimizer = read_tensors(directory + "/optimizer.safetensors");
  checkpoint.random_states = read_tensors(directory + "/random.safetensors");
  checkpoint.state = nlohmann::json::parse(read_text(directory + "/state.json"), nullptr, false);
  if (checkpoint.state.is_discarded()) throw Error(ErrorCode::kCheckpoint, directory + "/state.json: not valid JSON");
  checkpoint.recipe_yaml = read_text(directory + "/recipe.yaml");
  return checkpoint;
}

std::vector<std::string> list_training_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir(run_dir), error)) {
    const std::string name = entry.path().filename().string();
    const int64_t step = step_of(name);
    if (step >= 0 && entry.is_directory() && fs::exists(entry.path() / "manifest.json")) {
      found.emplace_back(step, entry.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> paths;
  for (auto& item : found) paths.push_back(std::move(item.second));
  return paths;
}

std::optional<std::string> newest_valid_checkpoint(const std::string& run_dir) {
  auto checkpoints = list_training_checkpoints(run_dir);
  for (auto it = checkpoints.rbegin(); it != checkpoints.rend(); ++it) {
    try {
      verify_training_checkpoint(*it);
      return *it;
    } catch (const Error& error) {
      std::fprintf(stderr, "resume: skipping %s: %s\n", it->c_str(), error.what());
    }
  }
  return std::nullopt;
}

void prune_training_checkpoints(const std::string& run_dir, int64_t keep_last) {
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir(run_dir), error)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 8 && name[0] == '.' && name.substr(name.size() - 8) == ".staging") remove_tree(entry.path().string());
  }
  if (keep_last <= 0) return;
  const auto checkpoints = list_training_checkpoints(run_dir);
  for (size_t index = 0; index + static_cast<size_t>(keep_last) < checkpoints.size(); ++index) {
    // Renamed out of sight first (one atomic step): a kill during the removal then leaves a
    // staging leftover, removed above next time, never a checkpoint that looks whole without its files.
    const fs::path path(checkpoints[index]);
    const fs::path hidden = path.parent_path() / ("." + path.filename().string() + ".pruned.staging");
    std::error_code rename_error;
    fs::rename(path, hidden, rename_error);
    remove_tree(rename_error ? path.string() : hidden.string());
  }
}

}  // namespace qtrain::trainer
