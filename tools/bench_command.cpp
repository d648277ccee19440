// qtrain bench: training throughput and peak memory of a Llama-, Qwen-, Mistral-, Gemma- or Phi-3-shaped model with random
// weights, built directly on the device (no checkpoint on disk): QLoRA (NF4 double-quant base),
// LoRA on an LLM.int8 base (--quant int8) or LoRA (16-bit base), LoRA on all 7 projections, AdamW
// (or --optim adamw8bit), random tokens. The step is a run's (trainer/training_step.h), with
// the trained parameters, optimizer and loss chunk a recipe of these settings gives.
//
// Model FLOPs per token (what MFU counts; recomputation under checkpointing is not counted):
//   matmuls: forward 2 N, backward 2 N (gradients to the inputs only: the base is frozen and
//   the LoRA weights' gradients are negligible), N = projection and lm_head parameters;
//   attention: 4 L S d forward (QK^T and PV over the full S x S square, PaLM's convention,
//   d = heads x head_dim) and twice that backward.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>

#ifdef QTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "kernels/error.h"
#include "data/batching.h"
#include "qat/float8_matmul.h"
#include "qat/four_bit_codec.h"
#include "qat/lora_linear.h"
#include "qat/qat_lora_matmul.h"
#include "tools/commands.h"
#include "trainer/objectives/objectives.h"
#include "trainer/objectives/pair_log_probs.h"
#include "tools/kernel_profile.h"
#include "trainer/base/device.h"
#include "trainer/base/memory_stats.h"
#include "trainer/formats/training_checkpoint.h"
#include "trainer/model/activation_offload.h"
#include "trainer/model/llama.h"
#include "trainer/formats/llama_shapes.h"
#include "trainer/recipe/memory_plan.h"
#include "trainer/recipe/model_memory.h"
#include "trainer/recipe/base_quantization.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/training_step.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

constexpr double kGiB = double(1 << 30);

// The bf16 dense peak of the GPU, for MFU; 0 when unknown.
double peak_flops(const torch::Device& device) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const std::string name = at::cuda::getDeviceProperties(device.index())->name;
    if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) return 989e12;
    if (name.find("A100") != std::string::npos) return 312e12;
  }
#endif
  (void)device;
  return 0;
}

void synchronize(const torch::Device& device) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) at::cuda::getCurrentCUDAStream(device.index()).synchronize();
#endif
  (void)device;
}

// The run a bench measures, as a recipe: what Finetune would build from it decides what trains,
// the optimizer and the step (trainer/training_step.h).
trainer::Recipe bench_recipe(const trainer::BaseQuantizationRow& base, bool fake_quant, int64_t lora_rank,
                             const std::string& optimizer_name, bool checkpointing, int64_t loss_chunk) {
  auto recipe = trainer::default_recipe();
  recipe.quant = fake_quant                                     ? trainer::QuantMethod::kQat
                 : base.kind == trainer::BaseQuantization::kNone ? trainer::QuantMethod::kNone
                                                                 : trainer::QuantMethod::kQlora;
  if (base.kind != trainer::BaseQuantization::kNone) recipe.qlora.quant_type = base.kind;
  recipe.qat.base = base.kind;  // QAT-LoRA on this base (read only with quant: qat)
  recipe.qat.weights.scale_dtype = "fp16";  // GGUF Q4_0's grid: int4, groups of 32, fp16 scales
  recipe.lora.rank = lora_rank;
  recipe.lora.alpha = 2.0 * static_cast<double>(lora_rank);
  recipe.lora.dropout = 0.0;
  recipe.optim.name = optimizer_name;
  recipe.train.gradient_checkpointing = checkpointing;
  recipe.train.loss_chunk_tokens = std::max<int64_t>(loss_chunk, 0);
  return recipe;
}

// One micro-batch of random tokens, on the CPU as the data loader hands them out. samples > 0:
// each row packs that many samples of equal length (the last takes the remainder), as
// data::collate marks packed rows: positions restart at each sample, whose first token is no label;
// the first `whole_rows` rows hold one sample each (a document's full window, which collate puts
// first). pairs: the samples are preference pairs, the first quarter of each a prompt, not labelled.
// Token ids are drawn from [0, ids).
data::Batch random_batch(int64_t micro_batch, int64_t sequence, int64_t ids, int64_t samples = 0,
                         bool pairs = false, int64_t whole_rows = 0) {
  data::Batch batch;
  batch.input_ids = torch::randint(ids, {micro_batch, sequence}, torch::kInt64);
  batch.labels = batch.input_ids.clone();
  batch.input_tokens = micro_batch * sequence;
  batch.predicted_tokens = micro_batch * (sequence - 1);
  if (samples > 0) {
    batch.sample_ids = torch::empty({micro_batch, sequence}, torch::kInt64);
    batch.position_ids = torch::empty({micro_batch, sequence}, torch::kInt64);
    for (int64_t row = 0; row < micro_batch; ++row) {
      const int64_t row_samples = row < whole_rows ? 1 : samples;
      const int64_t length = sequence / row_samples;
      const auto sample =
          torch::clamp_max(torch::div(torch::arange(sequence, torch::kInt64), length, "floor"), row_samples - 1);
      const auto position = torch::arange(sequence, torch::kInt64) - sample * length;
      batch.sample_ids[row] = sample;
      batch.position_ids[row] = position;
      const auto unlabelled = pairs ? position < std::max<int64_t>(length / 4, 1) : position == 0;
      batch.labels[row].masked_fill_(unlabelled, data::kIgnoreLabel);
    }
    batch.predicted_tokens = batch.labels.index({torch::indexing::Slice(), torch::indexing::Slice(1, torch::indexing::None)})
                                 .ne(data::kIgnoreLabel)
                                 .sum()
                                 .item<int64_t>();
  }
  return batch;
}

// The caching allocator may use `gib` GiB of the device at most: an 80 GB card on a larger one.
void limit_device_memory(const torch::Device& device, double gib) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const double total = static_cast<double>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
    torch::empty({1}, torch::TensorOptions().device(device));  // the allocator starts with the first tensor
    c10::cuda::CUDACachingAllocator::setMemoryFraction(std::min(1.0, gib * kGiB / total), device.index());
    return;
  }
#endif
  throw Error(ErrorCode::kUsage, "--memory-limit-gib caps a GPU's memory; the device is " + device.str());
}

// Bytes the caching allocator can hand out on `device`: what the driver has free plus what the
// allocator holds already, within --memory-limit-gib.
double device_memory_budget(const torch::Device& device, double limit_gib) {
  // Nothing on a CPU (no free figure, nothing reserved).
  const double budget = trainer::device_free_bytes(device) + trainer::memory_usage(device).reserved_bytes;
  return limit_gib > 0 ? std::min(budget, limit_gib * kGiB) : budget;
}

// MemAvailable of /proc/meminfo: what the host can still pin.
double host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

using Measure = std::function<std::pair<double, double>(int64_t tokens, int64_t untimed, int64_t timed)>;

// --max-context: the longest sequence of one micro-batch that trains. A step's peak grows about
// linearly with the tokens (flash attention, the fused loss, MLP chunks), but not exactly: kernels
// pick other workspaces at other lengths. So probes double from `probe` until one reaches a quarter
// of the length they predict, the last two give bytes per token and a fixed part, and the longest
// length under the device's budget (and, offloading, the host's) is tried, 10% shorter after each
// out-of-memory. Returns it with the median of its `steps` timed steps.
std::pair<int64_t, double> longest_context(const torch::Device& device, int64_t probe, int64_t steps, double limit_gib,
                                           const Measure& measure, const trainer::LlamaOptions& llama,
                                           torch::ScalarType dtype, bool offloading) {
  if (!device.is_cuda()) throw Error(ErrorCode::kUsage, "--max-context searches a GPU's memory; the device is " + device.str());
  const auto round_down = [](double tokens) { return std::max<int64_t>(static_cast<int64_t>(tokens) / 1024 * 1024, 1024); };
  // The caching allocator's large blocks fragment: keep 4% of the budget free.
  const double budget = 0.96 * device_memory_budget(device, limit_gib);
  std::string bound = "the device's memory";
  double host_longest = std::numeric_limits<double>::infinity();
  if (offloading) {
    // Every layer's input waits on the host; buffers pinned by the probes are reused.
    const double host_per_token = static_cast<double>(llama.num_hidden_layers * llama.hidden_size * c10::elementSize(dtype));
    host_longest = 0.9 * (host_available_bytes() + static_cast<double>(trainer::ActivationOffload::pinned_bytes())) /
                   host_per_token;
  }
  std::vector<std::pair<int64_t, double>> peaks;  // tokens, peak bytes
  int64_t longest = 0;
  for (int64_t tokens = probe;; tokens *= 2) {
    peaks.emplace_back(tokens, measure(tokens, peaks.empty() ? 1 : 0, 1).second);
    trainer::release_cached_memory(device);
    std::printf("bench: probe %lld tokens: peak %s\n", static_cast<long long>(tokens), trainer::format_bytes(peaks.back().second).c_str());
    std::fflush(stdout);
    if (peaks.size() < 2) continue;
    const auto& [shorter_tokens, shorter_peak] = peaks[peaks.size() - 2];
    const double per_token = (peaks.back().second - shorter_peak) / static_cast<double>(tokens - shorter_tokens);
    if (per_token <= 0) continue;  // too short to see the growth: probe longer
    const double fixed = shorter_peak - per_token * static_cast<double>(shorter_tokens);
    const double predicted = (budget - fixed) / per_token;
    longest = round_down(std::min(predicted, host_longest));
    if (host_longest < predicted) bound = "the host's memory (offloaded layer inputs)";
    if (4 * tokens >= longest) {
      std::printf("bench: %s a token over %s fixed; %s to use: try %lld tokens (bound by %s)\n",
                  trainer::format_bytes(per_token).c_str(), trainer::format_bytes(fixed).c_str(),
                  trainer::format_bytes(budget).c_str(), static_cast<long long>(longest), bound.c_str());
      std::fflush(stdout);
      break;
    }
  }
  for (int attempt = 0;; ++attempt) {
    try {
      const double pinned_before = trainer::ActivationOffload::pinning_seconds();
      double seconds = measure(longest, 0, steps).first;
      const double pinning = trainer::ActivationOffload::pinning_seconds() - pinned_before;
      if (pinning > 0 && steps == 1) {
        // A run pins its buffers once; the step it does that in is not what its steps take.
        std::printf("bench: the step at %lld tokens spent %.1f s pinning host memory; its time leaves that out\n",
                    static_cast<long long>(longest), pinning);
        seconds -= pinning;
      }
      return {longest, seconds};
    } catch (const std::exception& error) {
      // The device's out-of-memory, or the host's (pinning the offloaded inputs).
      const auto* ours = dynamic_cast<const Error*>(&error);
      if (attempt == 3 || (!dynamic_cast<const c10::OutOfMemoryError*>(&error) &&
                           !(ours && ours->code() == ErrorCode::kOutOfMemory))) {
        throw;
      }
      std::printf("bench: %lld tokens ran out of memory; trying 10%% fewer\n", static_cast<long long>(longest));
      std::fflush(stdout);
      longest = round_down(0.9 * static_cast<double>(longest));
      trainer::release_cached_memory(device);
    }
  }
}

// What `qtrain bench` was asked to measure: its options as given, and what they resolve to.
struct BenchOptions {
  std::string shape;
  std::string quant;  // --quant as given (qlora: nf4)
  std::string optimizer_name;
  std::string dtype_name;
  std::string device_name;
  std::string lora_gradient;   // with --qat
  std::string memory;          // --memory: auto (a run's default plan) | manual
  std::string checkpoint_run;  // --save-checkpoint: RUN, or empty
  std::string trace_path;      // with --profile
  int64_t micro_batch = 0;
  int64_t sequence = 0;  // tokens; --max-context: the first probe's
  int64_t steps = 0;     // timed
  int64_t warmup = 0;
  int64_t lora_rank = 0;
  double lora_dropout = 0.0;
  int64_t layers = 0;  // --layers: the shape's first N decoder layers (0: all)
  int64_t loss_chunk = 0;  // 0 automatic, -1 unchunked
  int64_t profile_steps = 0;
  int64_t mlp_chunk = 0;
  int64_t bank_block_mb = 0;      // train.expert_bank_block_mb
  int64_t lm_head_block_mb = 0;   // train.lm_head_block_mb
  int64_t packed_samples = 0;
  int64_t packed_whole_rows = 0;  // with packed_samples: rows holding one sample each, first
  int64_t token_ids_below = 0;    // the batches' ids from [0, this); 0: the whole vocabulary
  std::string objective;  // train.objective
  int64_t checkpoint_every = 1;
  double memory_limit_gib = 0;
  bool fake_quant = false;  // --qat
  bool checkpointing = false;
  bool packed_mask = false;
  bool precompute_reference = false;       // dpo.precompute_reference: the reference's pass before the steps
  bool max_context = false;
  bool memory_phases = false;  // one more step, its peak by phase
  bool json = false;
  // Resolved:
  const trainer::BaseQuantizationRow* base = nullptr;
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kBFloat16;
  trainer::LlamaOptions llama;
  trainer::Recipe recipe;  // the run measured, as Finetune would build it
};

po::options_description bench_option_descriptions(BenchOptions& bench) {
  po::options_description options("bench options");
  options.add_options()
      ("shape", po::value(&bench.shape)->default_value("llama3-8b"), (trainer::llama_shape_names() + " (random weights)").c_str())
      ("quant", po::value(&bench.quant)->default_value("qlora"),
       "the frozen base: qlora (= nf4, double-quant), nf4, fp4, int8 (LLM.int8, threshold 6), fp8 (e4m3 rows, FP8 "
       "tensor cores) or none (16-bit)")
      ("optim", po::value(&bench.optimizer_name)->default_value("adamw"), "adamw or adamw8bit")
      ("micro-batch", po::value(&bench.micro_batch)->default_value(1), "sequences per step")
      ("seq", po::value(&bench.sequence)->default_value(2048), "tokens per sequence")
      ("checkpointing", po::bool_switch(), "recompute every decoder layer in backward")
      ("checkpoint-every", po::value(&bench.checkpoint_every)->default_value(1),
       "with --checkpointing: only every K-th decoder layer (train.gradient_checkpointing_every)")
      ("offload-activations", po::bool_switch(), "with --checkpointing: the layers' inputs wait in pinned host memory "
       "(train.offload_activations)")
      ("offload-branch-outputs", po::bool_switch(), "with the inputs offloaded: each layer's attention (and Gemma's MLP) "
       "output too, read back by the recomputation (train.offload_branch_outputs)")
      ("mlp-chunk", po::value(&bench.mlp_chunk)->default_value(0), "MLP chunk tokens (train.mlp_chunk_tokens); 0: whole")
      ("bank-block-mb", po::value(&bench.bank_block_mb)->default_value(0),
       "a mixture of experts' frozen bank built again (--rebuild-weights) is dequantized this many MB at a time "
       "(train.expert_bank_block_mb); 0: whole")
      ("lm-head-block-mb", po::value(&bench.lm_head_block_mb)->default_value(0),
       "with lm_head on the host (--lm-head-on-host, or the auto plan's): it comes to the fused loss a vocabulary "
       "tile at a time, at most this many MB of it on the device at once (train.lm_head_block_mb); 0: whole")
      ("unfused-loss", po::bool_switch(), "each loss chunk's whole logits (train.fused_loss: false)")
      ("precompute-reference", po::bool_switch(), "with --objective dpo: the reference's log-probabilities computed in a "
       "pass before the steps (dpo.precompute_reference), not in each step; that pass's time is reported beside them")
      ("objective", po::value(&bench.objective)->default_value("sft"),
       "sft, or dpo / orpo / simpo (train.objective): each row a preference pair, the prompt with a chosen and a "
       "rejected completion of --seq / 2 tokens each (the first quarter of each the prompt); compare with sft "
       "--packed-samples 2, the same tokens")
      ("packed-samples", po::value(&bench.packed_samples)->default_value(0),
       "pack each sequence with this many samples of equal length (attention stays inside each); 0: unpacked")
      ("packed-whole-rows", po::value(&bench.packed_whole_rows)->default_value(0),
       "with --packed-samples: the first this many rows of each micro-batch hold one sample each, as a packed "
       "document's full windows do (packed Brown text: about 3 of 4)")
      ("token-ids-below", po::value(&bench.token_ids_below)->default_value(0),
       "draw the batches' token ids from [0, N) instead of the whole vocabulary (the real command on "
       "tools/random_checkpoint.py's model sees only its tokenizer's 8,192 ids)")
      ("packed-mask", po::bool_switch(), "with --packed-samples: SDPA over the written-out block-causal mask instead "
       "of flash attention over the samples' spans (to compare)")
      ("rebuild-weights", po::bool_switch(), "with --checkpointing: dequantize again in backward instead of keeping "
       "a recomputed layer's weights (train.keep_built_weights: false)")
      ("embeddings-on-host", po::bool_switch(), "the input embedding table stays on the host (train.embeddings_on_host)")
      ("lm-head-on-host", po::bool_switch(), "lm_head waits on the host and visits the device for the loss "
       "(train.lm_head_on_host)")
      ("optimizer-states-on-host", po::bool_switch(), "the optimizer's state waits on the host between steps "
       "(train.optimizer_states_on_host)")
      ("memory", po::value(&bench.memory)->default_value("auto"),
       "auto: the host switches a run's train.memory: auto turns on besides those given (trainer/recipe/memory_plan.h); "
       "manual: only the switches given")
      ("max-context", po::bool_switch(),
       "find the longest sequence one micro-batch trains in the GPU's memory: measure the peak at two lengths, "
       "extrapolate, then train at the longest that fits (stepping down on out-of-memory); prints its tokens/s")
      ("memory-limit-gib", po::value(&bench.memory_limit_gib)->default_value(0.0),
       "cap the device memory the caching allocator may use (e.g. 79 to act as an 80 GB card on a larger one); "
       "0: the whole device")
      ("dora", po::bool_switch(), "DoRA adapters (lora.use_dora) instead of LoRA")
      ("fp8-fast-accumulation", po::bool_switch(), "with --quant fp8 or --fp8-compute: the forward's FP8 matmuls "
       "unpromoted (qlora.fp8_fast_accumulation)")
      ("fp8-compute", po::bool_switch(), "with a 4-bit --quant: the adapted projections multiply on FP8 tensor cores, "
       "dequantizing to e4m3 rows; with --quant none: from e4m3 rows of the 16-bit weights, which wait on the host "
       "(qlora.fp8_compute)")
      ("qat", po::bool_switch(), "fake-quantize the merged weights (int4, groups of 32, fp16 scales) over the --quant base, "
       "as quant: qat with qat.base")
      ("lora-gradient", po::value(&bench.lora_gradient)->default_value("identity"),
       "with --qat: the adapters' gradient, identity or masked (qat.lora_gradient)")
      ("loss-chunk", po::value(&bench.loss_chunk)->default_value(0), "loss chunk tokens; 0 automatic, -1 unchunked")
      ("dtype", po::value(&bench.dtype_name)->default_value("bf16"), "compute dtype: bf16, fp16 or fp32")
      ("device", po::value(&bench.device_name)->default_value("auto"), "cuda, cpu or auto")
      ("lora-rank", po::value(&bench.lora_rank)->default_value(16), "LoRA rank (alpha = 2 rank)")
      ("lora-dropout", po::value(&bench.lora_dropout)->default_value(0.0), "dropout on the LoRA input (lora.dropout)")
      ("layers", po::value(&bench.layers)->default_value(0),
       "only the shape's first N decoder layers (a peer's checkpoint cut as deep, where the whole one would not fit its disk); 0: all")
      ("steps", po::value(&bench.steps)->default_value(5), "timed steps (the median is reported)")
      ("warmup", po::value(&bench.warmup)->default_value(2), "untimed steps first")
      ("save-checkpoint", po::value(&bench.checkpoint_run), "after the steps, time writing the training state into RUN/checkpoints")
      ("profile", po::value(&bench.profile_steps)->default_value(0),
       "after the timed steps, profile this many more and print where the GPU spent its time")
      ("trace", po::value(&bench.trace_path), "with --profile: also write a Chrome trace to this file, with each operator's input shapes")
      ("memory-phases", po::bool_switch(), "after the timed steps, one more step and its peak memory by phase (forward, "
       "loss, backward, update): where the step peaks (a GPU)")
      ("json", po::bool_switch(), "end with one JSON object");
  return options;
}

// The command line, read and checked; nothing when it asked for --help.
std::optional<BenchOptions> parse_bench_options(const Arguments& arguments) {
  BenchOptions bench;
  const auto options = bench_option_descriptions(bench);
  po::variables_map values;
  if (!parse_command_line("usage: qtrain bench [--shape S] [--quant Q] [--micro-batch B] [--seq T] [--checkpointing]",
                          options, arguments, values)) {
    return std::nullopt;
  }
  const auto flag = [&](const char* name) { return values[name].as<bool>(); };
  bench.base = &trainer::base_quantization_named(bench.quant == "qlora" ? "nf4" : bench.quant, "--quant");
  if (bench.steps < 1 || bench.micro_batch < 1 || bench.sequence < 2) {
    throw Error(ErrorCode::kUsage, "--steps, --micro-batch must be >= 1 and --seq >= 2");
  }
  bench.fake_quant = flag("qat");
  qat::parse_lora_gradient(bench.lora_gradient, "--lora-gradient");
  bench.device = trainer::resolve_device(bench.device_name);
  bench.memory_phases = flag("memory-phases");
  if (bench.memory_phases && !bench.device.is_cuda()) {
    throw Error(ErrorCode::kUsage, "--memory-phases reads a GPU's allocator; the device is " + bench.device.str());
  }
  bench.dtype = trainer::parse_dtype_name(bench.dtype_name, "--dtype");
  bench.checkpointing = flag("checkpointing");
  bench.llama = trainer::llama_shape(bench.shape);
  if (bench.bank_block_mb < 0 || bench.bank_block_mb > (int64_t{1} << 20)) {
    throw Error(ErrorCode::kUsage, "--bank-block-mb " + std::to_string(bench.bank_block_mb) +
                                       ": from 0 (the whole bank) to 1048576");
  }
  if (bench.token_ids_below < 0 || bench.token_ids_below > bench.llama.vocab_size) {
    throw Error(ErrorCode::kUsage, "--token-ids-below " + std::to_string(bench.token_ids_below) + ": the shape's vocabulary has " +
                                       std::to_string(bench.llama.vocab_size) + " ids (0: all of them)");
  }
  if (bench.layers < 0 || bench.layers > bench.llama.num_hidden_layers) {
    throw Error(ErrorCode::kUsage, "--layers " + std::to_string(bench.layers) + ": the shape has " +
                                       std::to_string(bench.llama.num_hidden_layers) + " layers");
  }
  if (bench.layers > 0) {
    auto& llama = bench.llama;
    llama.num_hidden_layers = bench.layers;
    for (auto* per_layer : {&llama.sliding_layers, &llama.dense_layers}) {
      if (per_layer->size() > static_cast<size_t>(bench.layers)) per_layer->resize(static_cast<size_t>(bench.layers));
    }
  }
  auto& recipe = bench.recipe;
  recipe = bench_recipe(*bench.base, bench.fake_quant, bench.lora_rank, bench.optimizer_name, bench.checkpointing,
                        bench.loss_chunk);
  recipe.lora.dropout = bench.lora_dropout;  // LoraLinear refuses a value outside [0, 1)
  // Every projection of the shape's block (Phi-3's fused ones by their own names, a mixture of
  // experts' banks), but a router, which the peers' recipes leave frozen; a quantized base keeps it dense.
  recipe.lora.target_modules = trainer::projections_but_dense_base(bench.llama);
  recipe.qat.target_modules = recipe.lora.target_modules;
  for (const auto& name : trainer::dense_base_projections(bench.llama)) recipe.qlora.skip_modules.push_back(name);
  recipe.lora.use_dora = flag("dora");
  recipe.qlora.fp8_fast_accumulation = flag("fp8-fast-accumulation");
  recipe.qlora.fp8_compute = flag("fp8-compute");
  recipe.qat.lora_gradient = bench.lora_gradient;
  recipe.train.offload_activations = flag("offload-activations");
  recipe.train.offload_branch_outputs = flag("offload-branch-outputs");
  recipe.train.mlp_chunk_tokens = bench.mlp_chunk;
  recipe.train.expert_bank_block_mb = bench.bank_block_mb;
  recipe.train.lm_head_block_mb = bench.lm_head_block_mb;
  recipe.train.fused_loss = !flag("unfused-loss");
  recipe.train.keep_built_weights = !flag("rebuild-weights");
  recipe.train.embeddings_on_host = flag("embeddings-on-host");
  recipe.train.lm_head_on_host = flag("lm-head-on-host");
  recipe.train.optimizer_states_on_host = flag("optimizer-states-on-host");
  if (bench.memory != "auto" && bench.memory != "manual") throw Error(ErrorCode::kUsage, "--memory is auto or manual");
  if (bench.packed_whole_rows < 0 || bench.packed_whole_rows > bench.micro_batch ||
      (bench.packed_whole_rows > 0 && bench.packed_samples == 0)) {
    throw Error(ErrorCode::kUsage, "--packed-whole-rows must be 0..--micro-batch, with --packed-samples");
  }
  recipe.train.memory = bench.memory;
  if (bench.checkpoint_every < 1) throw Error(ErrorCode::kUsage, "--checkpoint-every must be >= 1");
  if (bench.checkpoint_every > 1 && !bench.checkpointing) {
    throw Error(ErrorCode::kUsage, "--checkpoint-every picks the layers --checkpointing recomputes: add --checkpointing");
  }
  recipe.train.gradient_checkpointing_every = bench.checkpoint_every;
  if ((recipe.train.offload_activations || recipe.train.offload_branch_outputs) && !bench.checkpointing) {
    throw Error(ErrorCode::kUsage, "--offload-activations and --offload-branch-outputs move what --checkpointing keeps: "
                                   "add --checkpointing");
  }
  bench.precompute_reference = flag("precompute-reference");
  if (bench.precompute_reference &&
      !trainer::objective_row(trainer::find_objective(bench.objective, "--objective").objective).reference) {
    throw Error(ErrorCode::kUsage, "--precompute-reference: --objective " + bench.objective +
                                       " has no reference model; use it with --objective dpo");
  }
  // A run's default, train.memory: auto; what it chose goes to stderr (beside --json's object).
  recipe.train.micro_batch_size = bench.micro_batch;  // the plan weighs the tokens of a micro-batch and a step
  recipe.data.max_seq_len = bench.sequence;
  // Fitted to the GPU's free memory, within --memory-limit-gib.
  const double device_bytes = bench.device.is_cuda() ? device_memory_budget(bench.device, bench.memory_limit_gib) : 0;
  const auto memory_plan = trainer::plan_memory(recipe, bench.llama, bench.device.is_cuda(), device_bytes);
  for (const auto& line : trainer::describe_memory_plan(recipe, memory_plan, bench.device.is_cuda())) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  recipe.train.objective = trainer::find_objective(bench.objective, "--objective").name;
  if (trainer::find_objective(bench.objective, "--objective").pairs) {
    if (bench.packed_samples > 0) throw Error(ErrorCode::kUsage, "--objective " + bench.objective + " makes each row a pair: drop --packed-samples");
    bench.packed_samples = 2;
  }
  if (bench.packed_samples < 0 || bench.packed_samples > bench.sequence) {
    throw Error(ErrorCode::kUsage, "--packed-samples must be 0..--seq");
  }
  bench.packed_mask = flag("packed-mask");
  if (bench.packed_mask && bench.packed_samples == 0) {
    throw Error(ErrorCode::kUsage, "--packed-mask compares packed attention: add --packed-samples");
  }
  bench.max_context = flag("max-context");
  if (bench.max_context && bench.packed_samples > 0) throw Error(ErrorCode::kUsage, "--max-context measures one unpacked sequence");
  if (bench.max_context && bench.micro_batch != 1) {
    throw Error(ErrorCode::kUsage, "--max-context measures one sequence: --micro-batch 1");
  }
  bench.json = flag("json");
  return bench;
}

// The model a bench trains, built on the device, with the optimizer and the step a run of its
// recipe would use.
struct BenchRun {
  trainer::LlamaForCausalLM model{nullptr};
  trainer::TrainedParameters trained;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::unique_ptr<trainer::LossScaler> scaler;
  trainer::TrainingStepOptions step_options;  // as the step runs (loss_chunk_tokens -1: unchunked)
  std::unique_ptr<trainer::TrainingStep> step;
};

// The device's limits and what its tensor cores take, before anything is built on it.
void prepare_device(const BenchOptions& bench) {
  const auto& base = *bench.base;
  const auto& qlora = bench.recipe.qlora;
  if (bench.memory_limit_gib > 0) limit_device_memory(bench.device, bench.memory_limit_gib);
  if (base.kind == trainer::BaseQuantization::kFp8) {
    qat::require_float8_tensor_cores(bench.device, bench.dtype, "--quant fp8", "--dtype");
  }
  const bool four_bit = base.kind == trainer::BaseQuantization::kNf4 || base.kind == trainer::BaseQuantization::kFp4;
  if (qlora.fp8_compute && !four_bit && base.kind != trainer::BaseQuantization::kNone) {
    throw Error(ErrorCode::kUsage, "--fp8-compute needs a 4-bit (qlora, nf4, fp4) or 16-bit (none) --quant");
  }
  if (qlora.fp8_compute) qat::require_float8_tensor_cores(bench.device, bench.dtype, "--fp8-compute", "--dtype");
  if (qlora.fp8_fast_accumulation && base.kind != trainer::BaseQuantization::kFp8 && !qlora.fp8_compute) {
    throw Error(ErrorCode::kUsage, "--fp8-fast-accumulation needs --quant fp8 or --fp8-compute");
  }
}

BenchRun build_bench(const BenchOptions& bench) {
  const auto& recipe = bench.recipe;
  const auto& device = bench.device;
  const auto dtype = bench.dtype;
  const auto& base = *bench.base;
  torch::manual_seed(0);
  const auto four_bit_tables = qat::quantize_4bit(
      torch::randn({4096}) * 0.02, base.kind == trainer::BaseQuantization::kFp4 ? qat::FourBitType::kFp4 : qat::FourBitType::kNf4,
      recipe.qlora.blocksize, recipe.qlora.double_quant);
  const auto settings = trainer::base_quantization_settings(base.kind, recipe.qlora, dtype, device);
  const auto build_start = std::chrono::steady_clock::now();
  // Quantized projections are made on the device, one at a time: the 16-bit model never exists.
  const trainer::LinearFactory make_linear = [&](const std::string& name, const qat::DenseLinearOptions& linear)
      -> std::shared_ptr<qat::LinearLayer> {
    // Qwen2.5's q/k/v biases stay 16-bit beside the quantized weight, as bitsandbytes keeps them.
    const auto on_device = torch::TensorOptions().dtype(dtype).device(device);
    const auto bias = linear.bias ? torch::randn({linear.out_features}, on_device) * 0.02 : torch::Tensor();
    if (qat::module_name_matches(name, recipe.qlora.skip_modules)) return std::make_shared<qat::DenseLinear>(linear);
    return base.random_layer({linear, bias, device, four_bit_tables}, settings);
  };
  BenchRun run;
  run.model = trainer::LlamaForCausalLM(bench.llama, dtype, make_linear);
  auto& model = *run.model;
  model.to(device);
  const auto adapters = trainer::lora_adapter_config(recipe);
  qat::apply_lora(model, adapters.targets, adapters.lora);
  trainer::apply_recipe_qat(model, recipe);
  run.trained = trainer::mark_trained_parameters(model, recipe);
  model.train();
  trainer::apply_recipe_memory_settings(model, recipe);
  run.optimizer = trainer::recipe_optimizer(recipe, run.trained.tensors);
  run.scaler = std::make_unique<trainer::LossScaler>(/*enabled=*/dtype == torch::kFloat16);
  auto step_options = trainer::training_step_options(recipe, bench.llama.vocab_size, device);
  if (bench.loss_chunk < 0) step_options.loss_chunk_tokens = -1;
  if (bench.packed_mask) step_options.packed_attention = trainer::PackedAttention::kWrittenOutMask;
  run.step_options = step_options;
  run.step = std::make_unique<trainer::TrainingStep>(model, run.trained.tensors, *run.optimizer, *run.scaler, step_options);
  synchronize(device);
  std::printf("bench: model built in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - build_start).count());
  std::fflush(stdout);
  return run;
}

// What a bench measured.
struct BenchMeasurement {
  int64_t sequence = 0;  // tokens a sequence: --seq, or the longest --max-context found
  double step_seconds = 0;  // the median of the timed steps
  trainer::MemoryUsage memory;  // after the timed steps
  double checkpoint_seconds = 0;  // --save-checkpoint
  double reference_seconds = 0;   // --precompute-reference: its pass over a step's micro-batch (warm)
  std::vector<trainer::MemoryPhases::Phase> phases;  // --memory-phases
};

// The timed steps (or the --max-context search), then --profile's steps and --save-checkpoint's write.
BenchMeasurement measure_bench(const BenchOptions& bench, BenchRun& run) {
  const auto& device = bench.device;
  int64_t next_step = 0;
  const auto batches_of = [&](int64_t tokens) {
    const int64_t ids = bench.token_ids_below > 0 ? bench.token_ids_below : bench.llama.vocab_size;
    return std::vector<data::Batch>{random_batch(bench.micro_batch, tokens, ids, bench.packed_samples,
                                                 bench.recipe.train.objective != "sft", bench.packed_whole_rows)};
  };
  BenchMeasurement measured;
  // --precompute-reference: the batches with their reference log-probabilities, as the run's pass
  // before training leaves them; that pass's time on its second round (the first builds kernels)
  // into `seconds`.
  const auto with_reference = [&](std::vector<data::Batch> batches, double& seconds) {
    if (!bench.precompute_reference) return batches;
    for (int round = 0; round < 2; ++round) {
      synchronize(device);
      const auto start = std::chrono::steady_clock::now();
      for (auto& batch : batches) {
        batch.reference_log_probs = torch::Tensor();
        const auto reference =
            trainer::reference_log_probs(*run.model, trainer::batch_on_device(batch, device),
                                         run.step_options.loss_options(), run.step_options.packed_attention);
        batch.reference_log_probs = torch::stack({reference.chosen, reference.rejected}, 1).to(torch::kFloat64).cpu();
      }
      synchronize(device);
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    return batches;
  };
  // `timed` steps of `tokens`-long sequences after `untimed` ones: the median step time and the
  // peak memory of the timed steps.
  const auto measure = [&](int64_t tokens, int64_t untimed, int64_t timed) {
    const auto batches = with_reference(batches_of(tokens), measured.reference_seconds);
    std::vector<double> seconds;
    trainer::reset_peak_memory(device);
    for (int64_t step = 0; step < untimed + timed; ++step) {
      if (step == untimed) trainer::reset_peak_memory(device);
      synchronize(device);
      const auto start = std::chrono::steady_clock::now();
      run.step->run(batches, next_step++);
      synchronize(device);
      if (step >= untimed) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(seconds.begin(), seconds.end());
    return std::make_pair(seconds[seconds.size() / 2], trainer::memory_usage(device).peak_bytes);
  };
  measured.sequence = bench.sequence;
  if (bench.max_context) {
    std::tie(measured.sequence, measured.step_seconds) =
        longest_context(device, bench.sequence, bench.steps, bench.memory_limit_gib, measure, bench.llama, bench.dtype,
                        bench.recipe.train.offload_activations);
  } else {
    measured.step_seconds = measure(bench.sequence, bench.warmup, bench.steps).first;
  }
  measured.memory = trainer::memory_usage(device);
  if (bench.profile_steps > 0) {
    double profiled_reference_seconds = 0;  // the report keeps the timed steps'
    const auto batches = with_reference(batches_of(measured.sequence), profiled_reference_seconds);
    KernelProfile profile(device.is_cuda(), /*record_shapes=*/!bench.trace_path.empty());
    for (int64_t step = 0; step < bench.profile_steps; ++step) run.step->run(batches, next_step++);
    synchronize(device);
    profile.finish(bench.trace_path, bench.profile_steps, 25, std::cout);
  }
  if (bench.memory_phases) {
    double phase_reference_seconds = 0;  // the report keeps the timed steps'
    const auto batches = with_reference(batches_of(measured.sequence), phase_reference_seconds);
    trainer::MemoryPhases phases(device);
    run.step->set_memory_phases(&phases);
    run.step->run(batches, next_step++);
    run.step->set_memory_phases(nullptr);
    phases.finish();
    synchronize(device);
    measured.phases = phases.phases();
  }
  if (!bench.checkpoint_run.empty()) {
    // What a run's checkpoint holds for this model: LoRA weights and AdamW moments (the random,
    // loader and recipe parts are a few kilobytes).
    trainer::TrainingCheckpoint checkpoint;
    for (size_t index = 0; index < run.trained.names.size(); ++index) {
      checkpoint.trainable.emplace_back(run.trained.names[index], run.trained.tensors[index]);
    }
    run.step->settle_optimizer_state();
    checkpoint.optimizer = run.optimizer->state();
    checkpoint.state = {{"step", next_step}};
    const auto start = std::chrono::steady_clock::now();
    const auto path = trainer::write_training_checkpoint(bench.checkpoint_run, next_step, checkpoint);
    measured.checkpoint_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("bench: training checkpoint %s written in %.2f s\n", path.c_str(), measured.checkpoint_seconds);
  }
  return measured;
}

// The row's name as tools/bench.sh names rows: the base, then what runs on it.
std::string bench_row_name(const BenchOptions& bench) {
  const auto& recipe = bench.recipe;
  std::string name = bench.base->kind == trainer::BaseQuantization::kNf4 ? "qlora" : trainer::base_quantization_name(bench.base->kind);
  if (bench.fake_quant) name += bench.lora_gradient == "identity" ? "+qat" : "+qat(" + bench.lora_gradient + ")";
  if (recipe.lora.use_dora) name += "+dora";
  if (recipe.qlora.fp8_compute) name += "+fp8-compute";
  if (recipe.qlora.fp8_fast_accumulation) name += "+fast-accumulation";
  return name;
}

// Tokens per second, MFU and peak memory, as lines and with --json as one JSON object.
void report_bench(const BenchOptions& bench, const BenchRun& run, const BenchMeasurement& measured) {
  const auto& llama = bench.llama;
  const auto& recipe = bench.recipe;
  const int64_t sequence = measured.sequence;
  const double median = measured.step_seconds;
  const double tokens_per_second = static_cast<double>(bench.micro_batch * sequence) / median;

  // A mixture of experts counts its top-k experts (and its router).
  const double matmul_parameters = trainer::active_matmul_weights(llama);
  // A token attends within its sample: packed rows do less attention work than one long sequence
  // (whole rows as much as unpacked ones).
  const double whole_share = static_cast<double>(bench.packed_whole_rows) / static_cast<double>(bench.micro_batch);
  const double attended = bench.packed_samples > 0
                              ? whole_share * sequence + (1 - whole_share) * static_cast<double>(sequence) / bench.packed_samples
                              : sequence;
  const double attention = 4.0 * llama.num_hidden_layers * attended * llama.num_attention_heads * llama.head_dim;
  const double flops_per_token = 4.0 * matmul_parameters + 3.0 * attention;
  const double peak = peak_flops(bench.device);
  const double mfu = peak > 0 ? tokens_per_second * flops_per_token / peak : 0.0;

  const std::string quant = bench_row_name(bench);
  std::printf("bench: %s %s + %s, %s compute on %s, micro-batch %lld x %lld, checkpointing %s%s, loss chunk %lld%s%s\n",
              bench.shape.c_str(), quant.c_str(), bench.optimizer_name.c_str(), bench.dtype_name.c_str(),
              bench.device.str().c_str(), static_cast<long long>(bench.micro_batch), static_cast<long long>(sequence),
              !bench.checkpointing ? "off"
              : bench.checkpoint_every == 1 ? "on"
                                            : ("every " + std::to_string(bench.checkpoint_every) + " layers").c_str(),
              recipe.train.offload_activations ? " (inputs offloaded)" : "",
              static_cast<long long>(run.step_options.loss_chunk_tokens),
              recipe.train.fused_loss ? " (fused)" : "",
              bench.mlp_chunk > 0 ? (", MLP chunk " + std::to_string(bench.mlp_chunk)).c_str() : "");
  if (recipe.train.objective != "sft") {
    std::printf("  objective: %s, each row a pair of %lld-token sequences (a quarter of each the prompt)%s\n",
                recipe.train.objective.c_str(), static_cast<long long>(sequence / 2),
                !trainer::objective_row(trainer::find_objective(recipe.train.objective).objective).reference ? ""
                : bench.precompute_reference ? "; the reference's log-probabilities computed before the steps"
                                             : "; the reference: the base with the adapters off, one more forward pass");
  } else if (bench.packed_samples > 0) {
    std::printf("  packed: %lld samples a sequence%s, attention %s\n", static_cast<long long>(bench.packed_samples),
                bench.packed_whole_rows > 0
                    ? (" (the first " + std::to_string(bench.packed_whole_rows) + " rows one sample each)").c_str()
                    : "",
                bench.packed_mask ? "over the written-out block-causal mask" : "over the samples' spans");
  }
  if (bench.token_ids_below > 0) {
    std::printf("  token ids drawn from [0, %lld) of the %lld\n", static_cast<long long>(bench.token_ids_below),
                static_cast<long long>(bench.llama.vocab_size));
  }
  if (recipe.train.offload_activations) {
    std::printf("  pinned host memory: %s (pinning took %.1f s in all, in the first step at each length)\n",
                trainer::format_bytes(static_cast<double>(trainer::ActivationOffload::pinned_bytes())).c_str(),
                trainer::ActivationOffload::pinning_seconds());
  }
  std::printf("  %.0f tokens/s (median of %lld steps, %.3f s each), MFU %.1f%%, peak memory %s\n", tokens_per_second,
              static_cast<long long>(bench.steps), median, 100.0 * mfu,
              trainer::format_bytes(measured.memory.peak_bytes).c_str());
  if (bench.precompute_reference) {
    std::printf("  the reference's pass before training: %.3f s a step's pairs; %.0f tokens/s with it counted\n",
                measured.reference_seconds,
                static_cast<double>(bench.micro_batch * sequence) / (median + measured.reference_seconds));
  }
  if (!measured.phases.empty()) {
    std::printf("  memory by phase (one more step; the allocator's peak within each):\n");
    for (const auto& phase : measured.phases) {
      std::printf("    %-9s %11s at its start, peak %s\n", phase.name.c_str(), trainer::format_bytes(phase.at_start_bytes).c_str(),
                  trainer::format_bytes(phase.peak_bytes).c_str());
    }
  }
  if (!bench.json) return;
  auto phases = nlohmann::json::array();
  for (const auto& phase : measured.phases) {
    phases.push_back({{"phase", phase.name}, {"at_start_bytes", phase.at_start_bytes}, {"peak_bytes", phase.peak_bytes}});
  }
  std::cout << nlohmann::json{{"shape", bench.shape},
                              {"layers", bench.llama.num_hidden_layers},
                              {"quant", quant},
                              {"optim", bench.optimizer_name},
                              {"dtype", bench.dtype_name},
                              {"micro_batch", bench.micro_batch},
                              {"seq", sequence},
                              {"checkpointing", bench.checkpointing},
                              {"offload_activations", recipe.train.offload_activations},
                              {"offload_branch_outputs", recipe.train.offload_branch_outputs},
                              {"mlp_chunk_tokens", bench.mlp_chunk},
                              {"expert_bank_block_mb", bench.bank_block_mb},
                              {"packed_samples", bench.packed_samples},
                              {"packed_whole_rows", bench.packed_whole_rows},
                              {"token_ids_below", bench.token_ids_below},
                              {"lora_dropout", recipe.lora.dropout},
                              {"objective", recipe.train.objective},
                              {"packed_mask", bench.packed_mask},
                              {"fused_loss", recipe.train.fused_loss},
                              {"precompute_reference", bench.precompute_reference},
                              {"reference_seconds", measured.reference_seconds},
                              {"keep_built_weights", recipe.train.keep_built_weights},
                              {"embeddings_on_host", recipe.train.embeddings_on_host},
                              {"lm_head_on_host", recipe.train.lm_head_on_host},
                              {"lm_head_block_mb", recipe.train.lm_head_block_mb},
                              {"optimizer_states_on_host", recipe.train.optimizer_states_on_host},
                              {"checkpoint_every", bench.checkpointing ? bench.checkpoint_every : 0},
                              {"max_context", bench.max_context},
                              {"pinned_host_bytes", trainer::ActivationOffload::pinned_bytes()},
                              {"pinning_seconds", trainer::ActivationOffload::pinning_seconds()},
                              {"dora", recipe.lora.use_dora},
                              {"loss_chunk_tokens", run.step_options.loss_chunk_tokens},
                              {"tokens_per_second", tokens_per_second},
                              {"mfu", mfu},
                              {"peak_memory_bytes", measured.memory.peak_bytes},
                              {"step_seconds", median},
                              {"checkpoint_seconds", measured.checkpoint_seconds},
                              {"memory_phases", phases}}
                   .dump()
            << std::endl;
}

}  // namespace

int run_bench(const Arguments& arguments) {
  const auto bench = parse_bench_options(arguments);
  if (!bench) return 0;
  prepare_device(*bench);
  auto run = build_bench(*bench);
  const auto measured = measure_bench(*bench, run);
  report_bench(*bench, run, measured);
  return 0;
}

}  // namespace qtrain::tools
