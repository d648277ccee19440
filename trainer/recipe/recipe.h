#pragma once
// A recipe: the YAML file a user points qtrain at, as typed structs, one per section.
//
// Every field is the recipe key of the same dotted name (`recipe.lora.rank` is `lora.rank`,
// `recipe.qat.weights.bits` is `qat.weights.bits`). Defaults, allowed values and what each
// key means live in one table, trainer/recipe/recipe_schema.cpp; `qtrain --print-recipe` prints it.
// The structs carry no defaults of their own: start from default_recipe() or load_recipe().
// A key whose value names a row of a table (quant, qlora.quant_type, qat.base, qat.*.format) is
// held as that table's enum, read from and printed as the row's name.
//
// Paths (model.path, data.train, data.eval, lora.init_from, export.out, train.output_dir)
// are stored absolute and lexically normal (data.train is a list of them; a single path
// written for it is a list of one): a path written in a recipe file is relative to
// that file's directory, one given with --set (or a default) to the current directory.
// An empty path means "not set".
#include <cstdint>
#include <string>
#include <vector>

#include "qat/quant_format.h"

namespace qtrain::trainer {

// `quant`: how the model is quantized while it trains. Parsed once where the recipe is read; the
// recipe spells it quant_method_name's way.
enum class QuantMethod {
  kQlora,  // a frozen quantized base (qlora.quant_type) + LoRA
  kQat,    // fake-quantized training (the qat section)
  kNone,   // a 16-bit model
};
// Every method, in the order `--print-recipe` lists them.
const std::vector<QuantMethod>& quant_methods();
const char* quant_method_name(QuantMethod method);  // "qlora" | "qat" | "none"

// The frozen base's storage (`qlora.quant_type`, `qat.base`); each kind's behaviour is a row of
// trainer/recipe/base_quantization.h.
enum class BaseQuantization { kNone, kNf4, kFp4, kInt8, kFp8 };

// How a recipe names each base kind and which keys may: one row per kind, free of LibTorch so
// that the recipe's parser (and its fuzz target) reads it.
struct BaseQuantizationName {
  BaseQuantization kind;
  const char* name;       // qlora.quant_type's and qat.base's spelling ("none": a 16-bit base)
  bool qlora_quant_type;  // qlora.quant_type may name it (none is `quant: none` there)
  bool qat_base;          // qat.base may name it (QAT-LoRA's frozen bases, docs/QAT.md)
};
const std::vector<BaseQuantizationName>& base_quantization_names();
const char* base_quantization_name(BaseQuantization kind);

struct ModelRecipe {
  std::string path;   // Hugging Face checkpoint directory
  std::string dtype;  // bf16 | fp16 | fp32: weights kept unquantized
};

// quant: qlora — the frozen base, as bitsandbytes stores it.
struct QloraRecipe {
  BaseQuantization quant_type{};  // nf4 | fp4 | int8 (LLM.int8) | fp8 (e4m3 rows: qat/float8_linear.h)
  int64_t blocksize{};
  bool double_quant{};
  double llm_int8_threshold{};
  bool fp8_fast_accumulation{};  // fp8 (or fp8_compute): the forward's matmuls without fp32 promotion
  bool fp8_compute{};            // nf4 / fp4: the base multiplies on FP8 tensor cores (qat/four_bit_linear.h)
  std::vector<std::string> skip_modules;
};

struct LoraRecipe {
  int64_t rank{};  // 0: no adapters, the full weights train
  double alpha{};
  double dropout{};
  bool rslora{};
  bool use_dora{};  // peft's use_dora (DoRA)
  std::vector<std::string> target_modules;
  std::string init_from;  // PEFT adapter directory; empty: fresh adapters
};

// One fake quantizer of quant: qat (qat.weights, qat.activations).
struct QuantizerRecipe {
  qat::QuantFormat format{};  // int | fp8_e4m3 | fp8_e5m2 | fp4_e2m1 | nf4 | fp4 | gguf (qat/quant_format.h)
  int64_t bits{};      // for format int; activations: 0 turns them off
  bool symmetric{};
  std::string granularity;  // per_tensor | per_channel | per_group | per_token
  int64_t group_size{};
  std::string scale_dtype;  // fp32 | fp16 (GGUF's d)
  std::string zero_point_domain = "int";  // int | float (torchao's int4 weight-only); a weights key only
  std::string gguf_type = "Q4_K_M";  // format gguf: llama.cpp's file type whose blocks each layer trains on; weights only
  // weights only: a compressed-tensors preset (qat/quant_presets.h) whose weight and activation
  // grids replace the other keys; empty: the keys as set.
  std::string scheme;
  std::string observer;     // dynamic | minmax | moving_average
  double momentum{};        // moving_average
  bool learned_scale{};
  std::string learned_scale_init;  // observer | paper
};

struct QatRecipe {
  QuantizerRecipe weights;
  QuantizerRecipe activations;
  BaseQuantization base{};    // none | nf4 | fp4 | int8: the frozen base under QAT-LoRA (qlora.* settings)
  std::string lora_gradient;  // identity | masked (qat/qat_lora_matmul.h)
  int64_t start_step{};
  std::vector<std::string> target_modules;
  int64_t calibration_batches{};  // qtrain quantize: batches that calibrate static activation ranges
};

struct DataRecipe {
  std::vector<std::string> train;  // files or directories of shards
  std::vector<double> weights;     // one per train source; empty: every sample once
  std::string eval;
  std::string format;  // text | instruct | chat | tokens
  std::string text_field;
  std::string prompt_template;  // instruct: a named template or a template text
  bool train_on_inputs{};
  std::string chat_template;  // chat: empty = the model's; llama3 | chatml
  int64_t max_seq_len{};
  std::string overlong;  // truncate | drop
  bool pack{};
  std::string pack_strategy;  // best_fit | wrapped (data/packing.h)
  bool shuffle{};
  bool skip_bad_records{};
  int64_t prefetch_batches{};
};

struct OptimRecipe {
  std::string name;  // adamw | adamw8bit | sgd
  double lr{};
  double weight_decay{};
  std::vector<double> betas;  // [beta1, beta2]
  double eps{};
};

struct ScheduleRecipe {
  std::string name;  // cosine | linear | constant
  int64_t warmup_steps{};
  double min_lr_ratio{};
};

struct TrainRecipe {
  std::string objective;  // sft | dpo | orpo | simpo (trainer/objectives/objectives.h)
  int64_t steps{};  // optimizer steps; 0: run `epochs` epochs
  int64_t epochs{};
  int64_t micro_batch_size{};
  int64_t grad_accum_steps{};
  std::string dtype;   // fp32 | bf16 | fp16 compute
  std::string device;  // cpu | cuda | auto
  int64_t seed{};
  double max_grad_norm{};  // 0: no clipping
  bool gradient_checkpointing{};
  int64_t gradient_checkpointing_every{};  // checkpoint every k-th decoder layer
  int64_t loss_chunk_tokens{};             // 0: sized from the vocabulary
  bool fused_loss{};                       // the loss over vocabulary tiles, never [chunk, vocab] logits
  std::string memory;                      // auto: the plan of trainer/recipe/memory_plan.h | manual
  bool offload_activations{};              // checkpointed layer inputs wait in pinned host memory
  bool offload_branch_outputs{};           // with it: each layer's attention (and Gemma's MLP) output too, read back by the recomputation
  int64_t mlp_chunk_tokens{};              // the MLP recomputed in chunks of this many tokens; 0: whole
  bool keep_built_weights{};               // a recomputed layer keeps its dequantized weights for backward
  int64_t expert_bank_block_mb{};          // a frozen expert bank built again is built this many MB at a time; 0: whole
  bool embeddings_on_host{};               // the frozen input embedding table stays in host memory
  bool lm_head_on_host{};                  // the frozen lm_head waits in host memory, visiting for the loss
  int64_t lm_head_block_mb{};              // with it and the fused loss: at most this many MB on the device, in tiles; 0: whole
  bool optimizer_states_on_host{};         // the optimizer's state waits in host memory between steps
  std::string nonfinite;                   // skip | abort
  int64_t max_skipped_steps{};             // consecutive skipped steps before the run stops
  int64_t empty_cache_steps{};             // 0: never
  std::string output_dir;       // the run directory
};

// The preference objectives' settings (train.objective dpo, orpo or simpo), named as TRL names them.
struct DpoRecipe {
  double beta{};                // DPO's beta; ORPO's lambda; SimPO's beta
  std::string loss_type;        // dpo: sigmoid | ipo | hinge | robust
  double label_smoothing{};     // dpo robust, simpo: the chance that a pair's preference is flipped
  double simpo_gamma{};         // simpo: the target reward margin
  double cpo_alpha{};           // simpo: weight of the NLL on the chosen completions (TRL's CPO)
  bool precompute_reference{};  // the reference log-probabilities in one pass before training
};

struct CheckpointRecipe {
  int64_t every{};      // steps; 0: only at the end
  int64_t keep_last{};  // 0: keep all
};

struct EvalRecipe {
  int64_t every{};        // steps; 0: only at the end
  int64_t max_batches{};  // 0: the whole eval split
};

struct LogRecipe {
  int64_t every{};
  bool tensorboard{};  // RUN/tensorboard/events.out.tfevents.*
};

struct DistRecipe {
  std::string backend;  // auto | nccl | gloo
  int64_t timeout_s{};
  int64_t bucket_mb{};
  std::string reduce;  // allreduce | ordered (trainer/dist/gradient_buckets.h)
};

struct ExportRecipe {
  std::vector<std::string> formats;  // peft | merged | gguf | safetensors-int | compressed-tensors
  std::string out;                   // empty: <train.output_dir>/export
  std::string gguf_type;             // auto | llama.cpp's file types (qat/gguf_file_types.h)
  std::string scheme;                // compressed-tensors: auto | a preset (qat/quant_presets.h)
};

struct Recipe {
  ModelRecipe model;
  QuantMethod quant{};  // qlora | qat | none
  QloraRecipe qlora;
  LoraRecipe lora;
  QatRecipe qat;
  DataRecipe data;
  OptimRecipe optim;
  ScheduleRecipe schedule;
  TrainRecipe train;
  DpoRecipe dpo;
  CheckpointRecipe checkpoint;
  EvalRecipe eval;
  LogRecipe log;
  DistRecipe dist;
  ExportRecipe export_;  // the `export` section (`export` is a C++ keyword)
};

// Every key at its default.
Recipe default_recipe();

// Reads the recipe at `path` (empty: defaults only), applies `set_overrides` in order
// ("lora.rank=8", "lora.target_modules=[q_proj,v_proj]": the value is YAML), and checks
// every value and the combination. Throws qtrain::Error naming the file and line (or the
// --set argument), the key, what it expects and what it got.
Recipe load_recipe(const std::string& path, const std::vector<std::string>& set_overrides);

// One `key=value` override. Checks the key and its value; load_recipe also checks that the
// keys agree with each other once every override is in.
Recipe apply_override(Recipe recipe, const std::string& key_equals_value);

// Every key, resolved, section by section, each with its doc as a comment. Loading the text
// again gives the same Recipe.
std::string recipe_to_yaml(const Recipe& recipe);

// A key whose value differs between two recipes.
struct RecipeDifference {
  std::string text;           // "key: before -> after"
  bool shapes_model = false;  // the key's RecipeKey::model_shaping
};
// The keys whose values differ, in table order.
std::vector<RecipeDifference> recipe_differences(const Recipe& before, const Recipe& after);

// Whether a run trains every weight (lora.rank 0 without an adapter to continue) rather than
// adapters.
bool trains_full_weights(const Recipe& recipe);

bool operator==(const Recipe& a, const Recipe& b);
inline bool operator!=(const Recipe& a, const Recipe& b) { return !(a == b); }

}  // namespace qtrain::trainer
