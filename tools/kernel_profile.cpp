#include "tools/kernel_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <ostream>
#include <vector>

namespace qtrain::tools {

namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> wanted{ActivityType::CPU};
  if (cuda) wanted.insert(ActivityType::CUDA);
  return wanted;
}

bool contains(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

// Coarse kinds, by the names cuBLAS, cuDNN, flash-attention and ATen give their kernels.
std::string kind_of(const std::string& name) {
  if (contains(name, "qtrain")) return "qtrain kernels";
  if (contains(name, "flash") || contains(name, "fmha") || contains(name, "attention") || contains(name, "cudnn")) {
    return "attention";
  }
  if (contains(name, "gemm") || contains(name, "xmma") || contains(name, "cutlass") || contains(name, "nvjet") ||
      contains(name, "Kernel2") || contains(name, "splitK")) {
    return "matmul";
  }
  if (contains(name, "Memcpy") || contains(name, "Memset") || contains(name, "copy")) return "copies";
  if (contains(name, "reduce") || contains(name, "Reduce") || contains(name, "norm") || contains(name, "softmax") ||
      contains(name, "nll") || contains(name, "Softmax")) {
    return "reductions";
  }
  return "elementwise and other";
}

struct Total {
  double seconds = 0;
  int64_t count = 0;
};

void print_totals(const std::vector<std::pair<std::string, Total>>& rows, double all, int64_t steps, int top,
                  std::ostream& out) {
  char line[512];
  for (int index = 0; index < static_cast<int>(rows.size()) && index < top; ++index) {
    const auto& [name, total] = rows[index];
    std::snprintf(line, sizeof line, "  %8.2f ms  %5.1f%%  %6lld  %s\n", 1e3 * total.seconds / steps,
                  100.0 * total.seconds / all, static_cast<long long>(total.count / steps),
                  name.substr(0, 150).c_str());
    out << line;
  }
}

std::vector<std::pair<std::string, Total>> by_time(const std::map<std::string, Total>& totals) {
  std::vector<std::pair<std::string, Total>> rows(totals.begin(), totals.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  return rows;
}

}  // namespace

KernelProfile::KernelProfile(bool cuda, bool record_shapes) {
  const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/record_shapes);
  profiler::prepareProfiler(config, activities(cuda));
  profiler::enableProfiler(config, activities(cuda));
  running_ = true;
}

KernelProfile::~KernelProfile() {
  if (running_) profiler::disableProfiler();
}

void KernelProfile::finish(const std::string& trace_path, int64_t steps, int top, std::ostream& out) {
  auto result = profiler::disableProfiler();
  running_ = false;
  std::map<std::string, Total> kernels, kinds, operators;
  double all = 0;
  for (const auto& event : result->events()) {
    if (event.deviceType() == c10::DeviceType::CPU) {
      // Inclusive host time of each operator (nested ones count in their parents too): where the
      // CPU, not the GPU, is what a step waits for.
      operators[event.name()].seconds += 1e-9 * static_cast<double>(event.durationNs());
      operators[event.name()].count += 1;
    }
    if (event.deviceType() != c10::DeviceType::CUDA) continue;
    const double seconds = 1e-9 * static_cast<double>(event.durationNs());
    const auto name = event.name();
    kernels[name].seconds += seconds;
    kernels[name].count += 1;
    kinds[kind_of(name)].seconds += seconds;
    kinds[kind_of(name)].count += 1;
    all += seconds;
  }
  steps = std::max<int64_t>(steps, 1);
  char line[256];
  std::snprintf(line, sizeof line, "profile: %.2f ms of GPU kernels per step (%lld steps)\n", 1e3 * all / steps,
                static_cast<long long>(steps));
  out << line;
  if (all == 0) out << "profile: no GPU kernels were recorded (the profile counts GPU time only)\n";
  if (all > 0) {
    out << "  per step     share   calls  kind\n";
    print_totals(by_time(kinds), all, steps, top, out);
    out << "  per step     share   calls  kernel\n";
    print_totals(by_time(kernels), all, steps, top, out);
  }
  if (!operators.empty()) {
    out << "  per step     share   calls  host operator (inclusive time; share of the longest)\n";
    const auto rows = by_time(operators);
    print_totals(rows, rows.front().second.seconds, steps, top, out);
  }
  if (!trace_path.empty()) {
    result->save(trace_path);
    out << "profile: trace written to " << trace_path << " (chrome://tracing, ui.perfetto.dev)\n";
  }
}

}  // namespace qtrain::tools
