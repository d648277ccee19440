#include "trainer/logging/run_log.h"

#include <dirent.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "kernels/error.h"
#include "trainer/base/file_system.h"
#include "trainer/logging/loss_curves.h"
#include "trainer/logging/metrics_file.h"
#include "trainer/logging/tensorboard_writer.h"

namespace qtrain::trainer {

namespace {

// metrics.jsonl's keys as TensorBoard shows them, with the HF Trainer's names where it has one.
const std::map<std::string, std::string>& tensorboard_tags() {
  static const std::map<std::string, std::string> tags = {
      {"loss", "train/loss"},
      {"lr", "train/learning_rate"},
      {"grad_norm", "train/grad_norm"},
      {"tokens_per_second", "train/tokens_per_second"},
      {"memory", "train/memory_bytes"},
      {"peak_memory", "train/peak_memory_bytes"},
      {"reserved_memory", "train/reserved_memory_bytes"},
      {"loss_scale", "train/loss_scale"},
      {"skipped_steps", "train/skipped_steps"},
      {"eval_loss", "eval/loss"},
      {"eval_perplexity", "eval/perplexity"},
  };
  return tags;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string metrics_path(const RunLogOptions& options) { return options.run_dir + "/metrics.jsonl"; }
std::string tensorboard_dir(const RunLogOptions& options) { return options.run_dir + "/tensorboard"; }

void remove_event_files(const std::string& directory) {
  DIR* folder = opendir(directory.c_str());
  if (folder == nullptr) return;
  while (const dirent* entry = readdir(folder)) {
    const std::string name = entry->d_name;
    if (name.rfind("events.out.tfevents.", 0) == 0) std::remove((directory + "/" + name).c_str());
  }
  closedir(folder);
}

}  // namespace

std::string tensorboard_tag(const std::string& metric) {
  const auto found = tensorboard_tags().find(metric);
  if (found != tensorboard_tags().end()) return found->second;
  // A preference objective's metrics keep TRL's names under the HF Trainer's sections:
  // rewards/chosen -> train/rewards/chosen, eval_rewards/chosen -> eval/rewards/chosen.
  const bool preference = metric.find('/') != std::string::npos || metric == "nll_loss" ||
                          metric.rfind("log_odds_", 0) == 0 || metric.rfind("eval_nll_loss", 0) == 0 ||
                          metric.rfind("eval_log_odds_", 0) == 0;
  if (!preference) return "";
  if (metric.rfind("eval_", 0) == 0) return "eval/" + metric.substr(5);
  return "train/" + metric;
}

RunLog::RunLog(RunLogOptions options, std::optional<int64_t> resumed_step) : options_(std::move(options)) {
  std::vector<nlohmann::json> kept;
  if (resumed_step && std::filesystem::exists(metrics_path(options_))) {
    std::ifstream file(metrics_path(options_), std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    text.resize(text.rfind('\n') + 1);  // a run killed mid-write leaves a torn last line: it goes
    for (auto& line : parse_metrics_lines(text, metrics_path(options_))) {
      if (line["step"].get<int64_t>() <= *resumed_step) kept.push_back(std::move(line));
    }
  }
  std::string text;
  for (const auto& line : kept) text += line.dump() + "\n";
  write_file_atomically(metrics_path(options_), text);
  remove_event_files(tensorboard_dir(options_));
  if (!options_.tensorboard) return;
  tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_dir(options_), now_seconds());
  for (const auto& line : kept) to_tensorboard(line);
  tensorboard_->flush();
}

RunLog::~RunLog() = default;

void RunLog::record(nlohmann::json line) {
  line["time"] = now_seconds();
  std::FILE* file = std::fopen(metrics_path(options_).c_str(), "a");
  const std::string text = line.dump() + "\n";
  const bool written = file != nullptr && std::fwrite(text.data(), 1, text.size(), file) == text.size();
  if (file == nullptr || std::fclose(file) != 0 || !written) {
    throw Error(ErrorCode::kFileSystem, metrics_path(options_) + ": cannot write (is the disk full?)");
  }
  if (!tensorboard_) return;
  to_tensorboard(line);
  tensorboard_->flush();
}

void RunLog::text(const std::string& tag, const std::string& text, int64_t step) {
  if (!tensorboard_) return;
  tensorboard_->text(tag, text, step, now_seconds());
  tensorboard_->flush();
}

void RunLog::to_tensorboard(const nlohmann::json& line) {
  const int64_t step = line["step"].get<int64_t>();
  const double time = line.contains("time") && line["time"].is_number() ? line["time"].get<double>() : now_seconds();
  for (const auto& [key, value] : line.items()) {
    const std::string tag = tensorboard_tag(key);
    if (tag.empty() || !value.is_number()) continue;
    tensorboard_->scalar(tag, value.get<double>(), step, time);
  }
}

std::string RunLog::write_curves() const {
  const std::string path = options_.run_dir + "/curves.svg";
  const auto name = std::filesystem::path(options_.run_dir).filename().string();
  write_loss_curves_svg({run_curves(read_metrics_file(metrics_path(options_)), name)}, path);
  return path;
}

}  // namespace qtrain::trainer
