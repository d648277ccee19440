// The CPU thread count: the cores other processes keep busy come off it, the user's
// OMP_NUM_THREADS is never overridden. (How much speed this keeps beside a busy process is a
// benchmark, tools/busy_cpu_check.sh, not a test.)
#include "trainer/base/cpu_threads.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <ATen/Parallel.h>
#include <cstdlib>
#include <optional>
#include <string>

namespace qtrain::trainer {
namespace {

TEST(CpuThreads, TheCoresOthersKeepBusyComeOffTheCountButNeverTheLastOne) {
  EXPECT_EQ(cpu_threads_beside(2, 0.0), 2);
  EXPECT_EQ(cpu_threads_beside(2, 0.4), 2);  // a light job: not worth a thread
  EXPECT_EQ(cpu_threads_beside(2, 0.6), 1);
  EXPECT_EQ(cpu_threads_beside(2, 1.0), 1);
  EXPECT_EQ(cpu_threads_beside(2, 5.0), 1);
  EXPECT_EQ(cpu_threads_beside(16, 3.2), 13);
  EXPECT_EQ(cpu_threads_beside(1, 1.0), 1);
  EXPECT_EQ(cpu_threads_beside(4, -0.2), 4);  // clock-tick rounding below zero
}

TEST(CpuThreads, AvailableCpusAreTheAffinityMaskAtMost) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_GE(available_cpus(), 1);
  EXPECT_LE(available_cpus(), CPU_COUNT(&set));
}

// Sets OMP_NUM_THREADS for the scope (unset for std::nullopt), and puts it back.
class ThreadVariable {
 public:
  explicit ThreadVariable(const std::optional<std::string>& value) {
    if (const char* old = std::getenv("OMP_NUM_THREADS")) old_ = old;
    if (value) setenv("OMP_NUM_THREADS", value->c_str(), 1);
    else unsetenv("OMP_NUM_THREADS");
  }
  ~ThreadVariable() {
    if (old_) setenv("OMP_NUM_THREADS", old_->c_str(), 1);
    else unsetenv("OMP_NUM_THREADS");
    at::set_num_threads(threads_);
  }

 private:
  std::optional<std::string> old_;
  int threads_ = at::get_num_threads();
};

TEST(CpuThreads, TheUsersOmpNumThreadsIsNeverOverridden) {
  const ThreadVariable user_says("1");
  at::set_num_threads(1);
  set_default_cpu_threads();
  CpuThreadGovernor governor(/*work_on_cpu=*/true, std::chrono::milliseconds(0));
  for (int i = 0; i < 3; ++i) governor.between_work();
  EXPECT_EQ(at::get_num_threads(), 1);
}

TEST(CpuThreads, WithoutOmpNumThreadsTheCountStartsAtTheAvailableCpusAndStaysInRange) {
  const ThreadVariable unset(std::nullopt);
  set_default_cpu_threads();
  EXPECT_EQ(at::get_num_threads(), available_cpus());
  CpuThreadGovernor governor(/*work_on_cpu=*/true, std::chrono::milliseconds(0));
  for (int i = 0; i < 5; ++i) {
    governor.between_work();
    EXPECT_GE(governor.threads(), 1);
    EXPECT_LE(governor.threads(), available_cpus());
    EXPECT_EQ(at::get_num_threads(), governor.threads());
  }
}

}  // namespace
}  // namespace qtrain::trainer
