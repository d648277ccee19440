#include "trainer/base/cpu_threads.h"

#include <ATen/Parallel.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <iterator>
#include <sstream>
#include <string>

namespace qtrain::trainer {

namespace {

bool user_set_thread_count() {
  const char* value = std::getenv("OMP_NUM_THREADS");
  return value != nullptr && *value != '\0';
}

std::vector<int> affinity_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    }
  }
  if (cpus.empty()) {
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    for (int cpu = 0; cpu < std::max(1L, online); ++cpu) cpus.push_back(cpu);
  }
  return cpus;
}

// cgroup v2's "QUOTA PERIOD" (or "max PERIOD": no quota) as whole CPUs, rounded up; 0 if none.
int cgroup_quota_cpus() {
  std::ifstream file("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (!(file >> quota >> period) || quota == "max" || period <= 0) return 0;
  try {
    return static_cast<int>(std::ceil(std::stod(quota) / period));
  } catch (const std::exception&) {
    return 0;
  }
}

CpuThreadGovernor::CpuTimes read_cpu_times() {
  static const std::vector<int> cpu_ids = affinity_cpus();
  CpuThreadGovernor::CpuTimes now;
  now.time = std::chrono::steady_clock::now();
  // cpuN user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
  std::ifstream stat("/proc/stat");
  for (std::string line; std::getline(stat, line);) {
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || !std::isdigit(static_cast<unsigned char>(line[3]))) continue;
    std::istringstream fields(line.substr(3));
    int cpu = -1;
    int64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    fields >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
    if (std::find(cpu_ids.begin(), cpu_ids.end(), cpu) == cpu_ids.end()) continue;
    now.busy_ticks += user + nice + system + irq + softirq + steal;
  }
  // Fields 14 and 15 of /proc/self/stat, after the parenthesised command name: utime, stime.
  std::ifstream self("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(self)), std::istreambuf_iterator<char>());
  const auto after_name = text.rfind(')');
  if (after_name != std::string::npos) {
    std::istringstream fields(text.substr(after_name + 2));
    std::string skip;
    for (int field = 3; field <= 13; ++field) fields >> skip;
    int64_t utime = 0, stime = 0;
    fields >> utime >> stime;
    now.own_ticks = utime + stime;
  }
  return now;
}

// Taken by set_default_cpu_threads(): where the first governor's first window starts.
std::optional<CpuThreadGovernor::CpuTimes>& startup_cpu_times() {
  static std::optional<CpuThreadGovernor::CpuTimes> times;
  return times;
}

}  // namespace

int available_cpus() {
  const int cpus = static_cast<int>(affinity_cpus().size());
  const int quota = cgroup_quota_cpus();
  return std::max(1, quota > 0 ? std::min(cpus, quota) : cpus);
}

int cpu_threads_beside(int cpus, double others_busy_cores) {
  if (!(others_busy_cores > 0)) return std::max(cpus, 1);  // none, or NaN from an empty window
  return std::clamp(cpus - static_cast<int>(std::lround(std::min(others_busy_cores, 1e6))), 1, std::max(cpus, 1));
}

void set_default_cpu_threads() {
  if (user_set_thread_count()) return;
  at::set_num_threads(available_cpus());
  startup_cpu_times() = read_cpu_times();
}

CpuThreadGovernor::CpuThreadGovernor(bool work_on_cpu, std::chrono::milliseconds interval)
    : active_(work_on_cpu && !user_set_thread_count()), interval_(interval) {
  if (!active_) return;
  cpus_ = available_cpus();
  // Start where the previous unit of work left off (an evaluation inside a training run).
  threads_ = std::clamp(at::get_num_threads(), 1, cpus_);
  const auto now = read_cpu_times();
  auto& startup = startup_cpu_times();
  if (startup && now.time - startup->time >= interval_) {
    // The first governor: the load since start-up decides the count before any work.
    last_ = *startup;
    decide(now);
  } else {
    last_ = now;
  }
  startup.reset();
}

void CpuThreadGovernor::between_work() {
  if (!active_ || std::chrono::steady_clock::now() - last_.time < interval_) return;
  decide(read_cpu_times());
}

void CpuThreadGovernor::decide(const CpuTimes& now) {
  const double seconds = std::chrono::duration<double>(now.time - last_.time).count();
  if (seconds <= 0) return;
  const double others_ticks = static_cast<double>((now.busy_ticks - last_.busy_ticks) - (now.own_ticks - last_.own_ticks));
  const double others_cores = others_ticks / (seconds * static_cast<double>(sysconf(_SC_CLK_TCK)));
  last_ = now;
  const int threads = cpu_threads_beside(cpus_, others_cores);
  if (threads != threads_) {
    threads_ = threads;
    at::set_num_threads(threads_);
  }
}

}  // namespace qtrain::trainer
