#pragma once
// How many threads qtrain's CPU work runs on, on a machine where other programs run too.
//
// LibTorch's CPU kernels run OpenMP parallel regions, and every region waits for its slowest
// thread. When another process keeps one of the cores busy, the thread that shares that core
// gets it for one time slice in two, and every region waits for it: on 2 cores beside one busy
// loop the demo trained 5.6x slower with 2 threads than with 1 (docs/PERFORMANCE.md). So the
// thread count follows the cores the others leave free.
//
// The user's OMP_NUM_THREADS always wins: then nothing here changes the count.
#include <chrono>
#include <cstdint>
#include <vector>

namespace qtrain::trainer {

// The CPUs this process may use: its affinity mask, lowered to the cgroup's CPU quota
// (cgroup v2 cpu.max, rounded up). At least 1.
int available_cpus();

// The thread count for `cpus` CPUs of which other processes keep `others_busy_cores` busy: the
// cores they take, rounded, come off; never below 1.
int cpu_threads_beside(int cpus, double others_busy_cores);

// At start-up: the intra-op thread count becomes available_cpus() (libgomp counts the affinity
// mask but not a container's quota), unless OMP_NUM_THREADS is set. Also takes the first reading
// of the CPUs' busy time, so that the first CpuThreadGovernor decides at once from what the
// other processes did while the model and data loaded.
void set_default_cpu_threads();

// Between units of CPU work (a training step, an eval batch, a generated token) follows the load
// that other processes put on this process's CPUs: at most every `interval` it reads their busy
// time (/proc/stat, per CPU of the affinity mask, steal included) less this process's own
// (/proc/self/stat); the cores the others kept busy, rounded, come off the thread count (never
// below 1) and come back once they are free. Calls at::set_num_threads from the calling thread,
// which must be the one that runs the work (OpenMP's thread count is per thread).
class CpuThreadGovernor {
 public:
  // Inactive (between_work does nothing) unless `work_on_cpu` and OMP_NUM_THREADS is unset.
  // Starts from the current thread count.
  explicit CpuThreadGovernor(bool work_on_cpu,
                             std::chrono::milliseconds interval = std::chrono::milliseconds(250));
  void between_work();
  int threads() const { return threads_; }
  bool active() const { return active_; }

  // Busy time of the CPUs we may use, in clock ticks.
  struct CpuTimes {
    std::chrono::steady_clock::time_point time;
    int64_t busy_ticks = 0;  // of every CPU we may use, all processes
    int64_t own_ticks = 0;   // this process, all its threads
  };

 private:
  void decide(const CpuTimes& now);

  bool active_ = false;
  int cpus_ = 1;
  int threads_ = 1;
  std::chrono::milliseconds interval_;
  CpuTimes last_;
};

}  // namespace qtrain::trainer
