// Expected values are transformers 5.17's schedulers (get_*_schedule_with_warmup on a LambdaLR
// with base lr 1e-3), read from optimizer.param_groups[0]["lr"] after `step` scheduler steps.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/error.h"
#include "optim/lr_schedule.h"

namespace qtrain::optim {
namespace {

LrScheduleOptions schedule(const std::string& name, int64_t warmup, int64_t total, double min_lr_ratio = 0.0) {
  LrScheduleOptions options;
  options.name = name;
  options.peak_lr = 1e-3;
  options.warmup_steps = warmup;
  options.total_steps = total;
  options.min_lr_ratio = min_lr_ratio;
  return options;
}

TEST(LrSchedule, CosineWithWarmupEqualsTransformers) {
  const auto options = schedule("cosine", 10, 110);
  const std::vector<std::pair<int64_t, double>> expected{
      {0, 0.0},     {1, 0.0001},   {5, 0.0005},  {9, 0.0009000000000000001}, {10, 0.001},
      {11, 0.0009997532801828658}, {35, 0.0008535533905932737}, {60, 0.0005}, {100, 2.4471741852423235e-05},
      {109, 2.467198171342e-07},   {110, 0.0}};
  for (const auto& [step, lr] : expected) EXPECT_NEAR(learning_rate_at(options, step), lr, 1e-18) << "step " << step;
}

TEST(LrSchedule, CosineWithoutWarmupStartsAtPeak) {
  const auto options = schedule("cosine", 0, 4);
  const std::vector<double> expected{0.001, 0.0008535533905932737, 0.0005, 0.00014644660940672628, 0.0};
  for (int64_t step = 0; step <= 4; ++step) EXPECT_NEAR(learning_rate_at(options, step), expected[step], 1e-18);
}

TEST(LrSchedule, CosineWithMinLrRatioEqualsTransformersCosineWithMinLr) {
  const auto options = schedule("cosine", 10, 110, 0.1);
  const std::vector<std::pair<int64_t, double>> expected{
      {0, 0.0}, {5, 0.0005}, {10, 0.001}, {35, 0.0008681980515339464}, {60, 0.00055}, {110, 0.0001}};
  for (const auto& [step, lr] : expected) EXPECT_NEAR(learning_rate_at(options, step), lr, 1e-18) << "step " << step;
}

TEST(LrSchedule, LinearWithWarmupEqualsTransformers) {
  const auto options = schedule("linear", 10, 110);
  const std::vector<std::pair<int64_t, double>> expected{{0, 0.0},     {5, 0.0005},  {10, 0.001}, {35, 0.00075},
                                                         {60, 0.0005}, {109, 1e-05}, {110, 0.0}};
  for (const auto& [step, lr] : expected) EXPECT_NEAR(learning_rate_at(options, step), lr, 1e-18) << "step " << step;
}

TEST(LrSchedule, LinearWithMinLrRatioDecaysToTheFloor) {
  // Closed form: ratio + (1 - ratio) * (1 - progress), progress = (s - 10) / 100.
  const auto options = schedule("linear", 10, 110, 0.2);
  EXPECT_NEAR(learning_rate_at(options, 10), 1e-3, 1e-18);
  EXPECT_NEAR(learning_rate_at(options, 60), 1e-3 * (0.2 + 0.8 * 0.5), 1e-18);
  EXPECT_NEAR(learning_rate_at(options, 110), 1e-3 * 0.2, 1e-18);
}

TEST(LrSchedule, ConstantWithWarmupEqualsTransformers) {
  const auto options = schedule("constant", 4, 20);
  const std::vector<std::pair<int64_t, double>> expected{{0, 0.0}, {1, 0.00025}, {3, 0.00075}, {4, 0.001}, {20, 0.001}};
  for (const auto& [step, lr] : expected) EXPECT_NEAR(learning_rate_at(options, step), lr, 1e-18) << "step " << step;
}

TEST(LrSchedule, StaysAtTheFloorPastTotalSteps) {
  EXPECT_EQ(learning_rate_at(schedule("cosine", 10, 110), 150), 0.0);
  EXPECT_NEAR(learning_rate_at(schedule("cosine", 10, 110, 0.1), 500), 1e-4, 1e-18);
  EXPECT_EQ(learning_rate_at(schedule("linear", 10, 110), 111), 0.0);
}

TEST(LrSchedule, RejectsOptionsAUserCouldNotHaveMeant) {
  EXPECT_THROW(learning_rate_at(schedule("cosin", 0, 10), 0), Error);
  EXPECT_THROW(learning_rate_at(schedule("cosine", -1, 10), 0), Error);
  EXPECT_THROW(learning_rate_at(schedule("cosine", 0, 0), 0), Error);
  EXPECT_THROW(learning_rate_at(schedule("cosine", 0, 10, 1.5), 0), Error);
  EXPECT_THROW(learning_rate_at(schedule("cosine", 0, 10), -1), Error);
  try {
    learning_rate_at(schedule("cosin", 0, 10), 0);
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("schedule.name 'cosin'"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace qtrain::optim
