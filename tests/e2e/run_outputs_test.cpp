// What a run leaves for people to look at, read by the tools people use: TensorBoard's own
// EventAccumulator reads RUN/tensorboard/ (the metrics of metrics.jsonl, the recipe as text), an
// XML parser reads RUN/curves.svg, a terminal shows the progress line; and models by name, found
// in a Hugging Face cache as huggingface_hub finds them.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "support.h"
#include "json_support.h"
#include "trainer/formats/hf_hub_cache.h"

namespace qtrain {
namespace {

using testing::CommandResult;
using testing::run_command;

using testing::qtrain;

std::string demo_recipe() { return testing::source_dir() + "/recipes/demo_tiny.yaml"; }
std::string tiny_llama() { return testing::source_dir() + "/recipes/demo/tiny-llama"; }

// A few steps of the demo recipe into run_dir, every step logged, evaluated every 2 steps.
CommandResult train(const std::string& run_dir, int steps, const std::string& extra = "") {
  return qtrain("--recipe " + demo_recipe() + " --set train.steps=" + std::to_string(steps) +
                " --set data.max_seq_len=64 --set eval.max_batches=1 --set eval.every=2 --set log.every=1"
                " --set train.output_dir=" + run_dir + extra);
}

using testing::metrics_lines;
using testing::logged;
// {step: value} of a metrics key.

// What TensorBoard reads from RUN/tensorboard (tests/interop/tensorboard_events.py).
nlohmann::json tensorboard_events(const std::string& run_dir) {
  const auto read = run_command(testing::python() + " " + testing::source_dir() +
                                "/tests/interop/tensorboard_events.py " + run_dir + "/tensorboard 2>/dev/null");
  EXPECT_EQ(read.status, 0) << read.output;
  return nlohmann::json::parse(read.output);
}

// A scalar series as TensorBoard holds it equals the metrics: each step once, each value the
// float32 of the logged double.
void expect_series(const nlohmann::json& events, const std::string& tag, const std::map<int64_t, double>& expected) {
  ASSERT_TRUE(events["scalars"].contains(tag)) << events.dump();
  std::map<int64_t, double> seen;
  for (const auto& point : events["scalars"][tag]) {
    const auto step = point[0].get<int64_t>();
    EXPECT_FALSE(seen.count(step)) << tag << ": step " << step << " twice";
    seen[step] = point[1].get<double>();
  }
  ASSERT_EQ(seen.size(), expected.size()) << tag;
  for (const auto& [step, value] : expected) {
    ASSERT_TRUE(seen.count(step)) << tag << " step " << step;
    EXPECT_NEAR(seen[step], value, 1e-6 * std::abs(value)) << tag << " step " << step;
  }
}

TEST(RunOutputs, TensorBoardReadsTheMetricsAndTheRecipeAndTheCurvesParseAsSvg) {
  const auto why = testing::python_lacks("tensorboard");
  if (!why.empty()) GTEST_SKIP() << why;
  testing::TempDir run;
  const auto trained = train(run.path(), 4);
  ASSERT_EQ(trained.status, 0) << trained.output;
  EXPECT_NE(trained.output.find("curves: " + run.path() + "/curves.svg"), std::string::npos) << trained.output;
  EXPECT_EQ(trained.output.find('\r'), std::string::npos) << "a pipe gets plain lines";
  const auto lines = metrics_lines(run.path());
  const auto events = tensorboard_events(run.path());
  EXPECT_EQ(events["files"].size(), 1u);
  expect_series(events, "train/loss", logged(lines, "loss"));
  expect_series(events, "train/learning_rate", logged(lines, "lr"));
  expect_series(events, "train/grad_norm", logged(lines, "grad_norm"));
  expect_series(events, "train/tokens_per_second", logged(lines, "tokens_per_second"));
  expect_series(events, "train/peak_memory_bytes", logged(lines, "peak_memory"));
  expect_series(events, "eval/loss", logged(lines, "eval_loss"));
  EXPECT_EQ(logged(lines, "loss").size(), 4u);
  EXPECT_EQ(logged(lines, "eval_loss").size(), 3u);  // steps 0, 2, 4
  ASSERT_TRUE(events["texts"].contains("recipe")) << events.dump();
  const std::string recipe = events["texts"]["recipe"][0][1];
  EXPECT_NE(recipe.find("max_seq_len: 64"), std::string::npos) << recipe;

  // The picture: one polyline point per logged step, read by Python's XML parser.
  const auto points = run_command(testing::python() + " -c '"
                                  "import sys, xml.etree.ElementTree as E\n"
                                  "root = E.parse(sys.argv[1]).getroot()\n"
                                  "assert root.tag == \"{http://www.w3.org/2000/svg}svg\", root.tag\n"
                                  "for kind in (\"train-loss\", \"eval-loss\", \"learning-rate\"):\n"
                                  "    line = root.find(\".//{http://www.w3.org/2000/svg}polyline[@class=\\\"%s\\\"]\" % kind)\n"
                                  "    print(kind, len(line.get(\"points\").split()))\n"
                                  "' " + run.file("curves.svg") + " 2>&1");
  ASSERT_EQ(points.status, 0) << points.output;
  EXPECT_EQ(points.output, "train-loss 4\neval-loss 3\nlearning-rate 4\n");
}

// A run resumed from an earlier checkpoint drops what was logged after it: every step is in
// metrics.jsonl and in TensorBoard once.
TEST(RunOutputs, AResumedRunLogsEachStepOnce) {
  const auto why = testing::python_lacks("tensorboard");
  if (!why.empty()) GTEST_SKIP() << why;
  testing::TempDir run;
  ASSERT_EQ(train(run.path(), 6, " --set checkpoint.every=2 --set checkpoint.keep_last=0").status, 0);
  const auto first = logged(metrics_lines(run.path()), "loss");
  std::ofstream(run.file("metrics.jsonl"), std::ios::app) << "{\"step\": 7, \"lo";  // killed mid-write
  const auto resumed = train(run.path(), 6, " --set checkpoint.every=2 --set checkpoint.keep_last=0 --resume " +
                                                run.file("checkpoints/step-000004"));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  const auto lines = metrics_lines(run.path());
  std::map<int64_t, int> train_lines;
  for (const auto& line : lines) {
    if (line.contains("loss")) ++train_lines[line["step"].get<int64_t>()];
  }
  EXPECT_EQ(train_lines, (std::map<int64_t, int>{{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}}));
  EXPECT_EQ(logged(lines, "loss"), first);  // steps 5 and 6 again, from the same state
  const auto events = tensorboard_events(run.path());
  EXPECT_EQ(events["files"].size(), 1u);
  expect_series(events, "train/loss", logged(lines, "loss"));
  expect_series(events, "eval/loss", logged(lines, "eval_loss"));
}

TEST(RunOutputs, TensorBoardOffWritesNoEventFiles) {
  testing::TempDir run;
  ASSERT_EQ(train(run.path(), 1, " --set log.tensorboard=false").status, 0);
  EXPECT_FALSE(std::filesystem::exists(run.file("tensorboard")) &&
               !std::filesystem::is_empty(run.file("tensorboard")));
  EXPECT_TRUE(std::filesystem::exists(run.file("curves.svg")));
}

TEST(RunOutputs, PlotDrawsSeveralRunsSideBySide) {
  testing::TempDir first, second, out;
  ASSERT_EQ(train(first.path(), 2, " --set log.tensorboard=false").status, 0);
  ASSERT_EQ(train(second.path(), 3, " --set log.tensorboard=false --set optim.lr=1e-3").status, 0);
  const auto plotted = qtrain("plot " + first.path() + " " + second.path() + " --out " + out.file("both.svg"));
  ASSERT_EQ(plotted.status, 0) << plotted.output;
  const std::string svg = testing::read_text(out.file("both.svg"));
  EXPECT_EQ(std::count(svg.begin(), svg.end(), '\n') > 10, true);
  size_t train_lines = 0;
  for (size_t at = svg.find("class=\"train-loss\""); at != std::string::npos; at = svg.find("class=\"train-loss\"", at + 1)) {
    ++train_lines;
  }
  EXPECT_EQ(train_lines, 2u) << svg;
  EXPECT_NE(plotted.output.find("3 train points"), std::string::npos) << plotted.output;
  const auto missing = qtrain("plot " + out.file("nothing"));
  EXPECT_EQ(missing.status, 2) << missing.output;
  EXPECT_NE(missing.output.find("metrics.jsonl"), std::string::npos) << missing.output;
}

// On a terminal (script(1) gives the run one) the progress line is redrawn in place; --no-progress
// and pipes get plain lines.
TEST(RunOutputs, TheProgressLineIsRedrawnOnATerminalOnly) {
  if (run_command("command -v script >/dev/null").status != 0) GTEST_SKIP() << "no script(1) to give qtrain a terminal";
  testing::TempDir run;
  const std::string command = testing::qtrain_binary() + " --recipe " + demo_recipe() +
                              " --set train.steps=3 --set data.max_seq_len=64 --set eval.max_batches=1"
                              " --set log.tensorboard=false --set train.output_dir=" + run.path();
  const auto on_terminal = run_command("script -qec '" + command + "' /dev/null 2>&1");
  ASSERT_EQ(on_terminal.status, 0) << on_terminal.output;
  EXPECT_NE(on_terminal.output.find("\r\033[K[######"), std::string::npos) << on_terminal.output;
  EXPECT_NE(on_terminal.output.find("] 3/3 | loss "), std::string::npos) << on_terminal.output;
  EXPECT_NE(on_terminal.output.find("tokens/s | eta "), std::string::npos) << on_terminal.output;
  const auto plain = run_command("script -qec '" + command + " --no-progress' /dev/null 2>&1");
  ASSERT_EQ(plain.status, 0) << plain.output;
  EXPECT_EQ(plain.output.find("\033[K"), std::string::npos) << plain.output;
  EXPECT_NE(plain.output.find("step 3/3 | loss "), std::string::npos) << plain.output;
}

// train.memory: auto, as `inspect --recipe` reports it for the shipped 8B recipe (a GPU run,
// micro-batch 2 x 2048 accumulated 8 times) on the tiny model's files.
TEST(RunOutputs, InspectSaysWhatTheMemoryPlanChoseAndWhy) {
  const auto inspected = qtrain("inspect --recipe " + testing::source_dir() + "/recipes/qlora_llama.yaml --set model.path=" +
                                tiny_llama());
  ASSERT_EQ(inspected.status, 0) << inspected.output;
  for (const char* line : {"memory: auto: train.offload_activations on (the checkpointed layer inputs wait in host memory)",
                           "memory: auto: train.embeddings_on_host on",
                           "memory: auto: train.lm_head_on_host on (the frozen lm_head visits the GPU for the loss only)",
                           "memory: auto: train.optimizer_states_on_host on"}) {
    EXPECT_NE(inspected.output.find(line), std::string::npos) << line << "\n" << inspected.output;
  }
  const auto manual = qtrain("inspect --recipe " + testing::source_dir() + "/recipes/qlora_llama.yaml --set model.path=" +
                             tiny_llama() + " --set train.memory=manual");
  EXPECT_NE(manual.output.find("memory: manual: the train.* switches as set"), std::string::npos) << manual.output;
}

// Models by name: a Hugging Face cache laid out as huggingface_hub leaves a download
// (tests/interop/hf_cache.py: blobs, snapshot links, refs), where its snapshot_download(...,
// local_files_only=True) finds the model.
class ModelsByName : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto why = testing::python_lacks("huggingface_hub");
    if (!why.empty()) GTEST_SKIP() << why;
  }

  // Lays tiny-llama out as REPO at REVISION; returns the snapshot huggingface_hub resolves.
  std::string make(const std::string& repo, const std::string& revision = "") {
    const auto made = testing::run_interop_script(
        "hf_cache.py", "make " + cache_.path() + " " + repo + " " + tiny_llama() +
                           (revision.empty() ? "" : " --revision " + revision) + " 2>/dev/null");
    EXPECT_EQ(made.status, 0) << made.output;
    const auto value = nlohmann::json::parse(made.output);
    EXPECT_TRUE(value.contains("snapshot")) << made.output;
    commit_ = value.value("commit", "");
    return value.value("snapshot", "");
  }

  std::string environment() const { return "HF_HUB_CACHE=" + cache_.path() + " "; }

  testing::TempDir cache_;
  std::string commit_;
};

TEST_F(ModelsByName, ResolvedAsHuggingfaceHubResolvesThem) {
  const std::string main_snapshot = make("org/tiny");
  const std::string branch_snapshot = make("org/tiny", "feature/x");
  const std::string bare = make("tiny");
  setenv("HF_HUB_CACHE", cache_.path().c_str(), 1);
  EXPECT_EQ(trainer::resolve_model_path("org/tiny", "--model"), main_snapshot);
  EXPECT_EQ(trainer::resolve_model_path("org/tiny@main", "--model"), main_snapshot);
  EXPECT_EQ(trainer::resolve_model_path("org/tiny@feature/x", "--model"), branch_snapshot);
  EXPECT_EQ(trainer::resolve_model_path("org/tiny@" + commit_, "--model"), branch_snapshot);
  EXPECT_EQ(trainer::resolve_model_path("tiny", "--model"), bare);
  // An existing folder is itself, whatever it looks like.
  EXPECT_EQ(trainer::resolve_model_path(tiny_llama(), "--model"), tiny_llama());
  const std::string message = testing::error_message([] { trainer::resolve_model_path("org/absent@v2", "model.path"); });
  EXPECT_NE(message.find("hf download org/absent --revision v2"), std::string::npos) << message;
  EXPECT_NE(message.find(cache_.path()), std::string::npos) << message;
  const auto reference = testing::run_interop_script("hf_cache.py", "resolve " + cache_.path() + " org/absent --revision v2");
  EXPECT_NE(reference.output.find("LocalEntryNotFoundError"), std::string::npos) << reference.output;
  // HF_HOME/hub when HF_HUB_CACHE is unset, as huggingface_hub's constants.
  unsetenv("HF_HUB_CACHE");
  testing::TempDir home;
  std::filesystem::create_symlink(cache_.path(), home.file("hub"));
  setenv("HF_HOME", home.path().c_str(), 1);
  const auto hub_says = run_command("HF_HUB_CACHE= ; unset HF_HUB_CACHE; HF_HOME=" + home.path() + " " + testing::python() +
                                    " " + testing::source_dir() + "/tests/interop/hf_cache.py resolve - org/tiny 2>/dev/null");
  EXPECT_EQ(nlohmann::json::parse(hub_says.output).value("snapshot", ""), trainer::resolve_model_path("org/tiny", "--model"))
      << hub_says.output;
  unsetenv("HF_HOME");
}

TEST_F(ModelsByName, TrainAndEvalTakeARepositoryId) {
  const std::string snapshot = make("org/tiny");
  testing::TempDir run;
  const auto trained = run_command(environment() + testing::qtrain_binary() + " --recipe " + demo_recipe() +
                                   " --set model.path=org/tiny --set train.steps=2 --set data.max_seq_len=64"
                                   " --set eval.max_batches=1 --set log.tensorboard=false --set train.output_dir=" +
                                   run.path() + " 2>&1");
  ASSERT_EQ(trained.status, 0) << trained.output;
  EXPECT_NE(trained.output.find("model: " + snapshot), std::string::npos) << trained.output;
  const std::string data = " --data " + testing::source_dir() + "/recipes/demo/brown-val.jsonl --max-seq-len 64 --max-batches 2 --device cpu --json";
  const auto by_name = run_command(environment() + testing::qtrain_binary() + " eval --model org/tiny" + data + " 2>&1");
  const auto by_path = qtrain("eval --model " + tiny_llama() + data);
  ASSERT_EQ(by_name.status, 0) << by_name.output;
  ASSERT_EQ(by_path.status, 0) << by_path.output;
  const auto loss_of = [](const CommandResult& result) {
    return nlohmann::json::parse(result.output.substr(result.output.rfind('{')))["loss"].get<double>();
  };
  EXPECT_EQ(loss_of(by_name), loss_of(by_path));
  const auto absent = run_command(environment() + testing::qtrain_binary() + " eval --model org/absent" + data + " 2>&1");
  EXPECT_EQ(absent.status, 2) << absent.output;
  EXPECT_NE(absent.output.find("hf download org/absent"), std::string::npos) << absent.output;
  // A recipe naming a repository that is not there still prints; training it is refused the same way.
  const std::string absent_recipe = " --recipe " + demo_recipe() + " --set model.path=org/absent@v2";
  EXPECT_EQ(run_command(environment() + testing::qtrain_binary() + absent_recipe + " --print-recipe >/dev/null").status, 0);
  const auto refused = run_command(environment() + testing::qtrain_binary() + absent_recipe + " 2>&1");
  EXPECT_EQ(refused.status, 2) << refused.output;
  EXPECT_NE(refused.output.find("model.path 'org/absent@v2'"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("hf download org/absent --revision v2"), std::string::npos) << refused.output;
}

}  // namespace
}  // namespace qtrain
