// Every recipe key, its default and what it allows: the one place defaults live.
#include "trainer/recipe/recipe_schema.h"

#include "data/packing.h"
#include "qat/lora_options.h"
#include "qat/gguf_file_types.h"
#include "qat/quant_presets.h"
#include "trainer/formats/export_formats.h"
#include "trainer/model/llama_options.h"
#include "trainer/objectives/objectives.h"

#include <algorithm>
#include <iterator>

namespace qtrain::trainer {
namespace {

RecipeKey key(std::string name, std::string default_yaml, RecipeField (*field)(Recipe&),
              std::string doc) {
  RecipeKey entry;
  entry.name = std::move(name);
  entry.default_yaml = std::move(default_yaml);
  entry.field = field;
  entry.doc = std::move(doc);
  return entry;
}

// The Recipe field of a key, as a function pointer the table can hold.
#define QTRAIN_FIELD(member) [](Recipe& recipe) -> RecipeField { return &recipe.member; }

// "[q_proj, k_proj, ...]": every projection of a decoder block, as a YAML list.
std::string all_projections_yaml() {
  std::string list;
  for (const auto& name : decoder_projection_names()) list += (list.empty() ? "[" : ", ") + name;
  return list + "]";
}
const std::vector<std::string> kComputeDtypes = {"bf16", "fp16", "fp32"};

void append(std::vector<RecipeKey>& keys, std::vector<RecipeKey> more) {
  keys.insert(keys.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
}

// An enum's names from the table that names it, in its order: `name_of` gives a row's value and
// name.
template <typename Enum, typename Rows, typename NameOf>
EnumNames<Enum> enum_names_from(const Rows& rows, const NameOf& name_of) {
  EnumNames<Enum> all;
  for (const auto& row : rows) all.emplace_back(name_of(row));
  return all;
}

// The choices of an enum key: every value's name, in its table's order.
template <typename Enum>
std::vector<std::string> all_names() {
  std::vector<std::string> names;
  for (const auto& [value, name] : enum_names(Enum{})) names.push_back(name);
  return names;
}

// The base kinds a key may name: the rows that `named_by` marks.
std::vector<std::string> base_names(bool BaseQuantizationName::*named_by) {
  std::vector<std::string> names;
  for (const auto& row : base_quantization_names()) {
    if (row.*named_by) names.push_back(row.name);
  }
  return names;
}

std::vector<RecipeKey> model_keys() {
  return {
      key("model.path", "\"\"", QTRAIN_FIELD(model.path),
          "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), or ORG/NAME[@REVISION] "
          "in the Hugging Face cache").shapes_model()
          .model_path(),
      key("model.dtype", "bf16", QTRAIN_FIELD(model.dtype),
          "dtype of the weights kept unquantized (all of them with quant: none)")
          .one_of(kComputeDtypes),
  };
}

std::vector<RecipeKey> quant_keys() {
  return {
      key("quant", "qlora", QTRAIN_FIELD(quant),
          "qlora: frozen 4-bit/8-bit base + LoRA; qat: fake-quantized training; none: plain").shapes_model()
          .one_of(all_names<QuantMethod>()),
  };
}

std::vector<RecipeKey> qlora_keys() {
  return {
      key("qlora.quant_type", "nf4", QTRAIN_FIELD(qlora.quant_type),
          "base format: bitsandbytes NF4 or FP4, int8 (LLM.int8 rows), or fp8 (e4m3 rows, FP8 tensor-core matmuls)")
          .shapes_model()
          .one_of(base_names(&BaseQuantizationName::qlora_quant_type)),
      key("qlora.blocksize", "64", QTRAIN_FIELD(qlora.blocksize),
          "weights sharing one absmax (4-bit formats)").shapes_model()
          .one_of({"64", "128", "256", "512", "1024", "2048", "4096"}),
      key("qlora.double_quant", "true", QTRAIN_FIELD(qlora.double_quant),
          "quantize the absmax too (8-bit, blocks of 256), as bnb_4bit_use_double_quant").shapes_model(),
      key("qlora.fp8_fast_accumulation", "false", QTRAIN_FIELD(qlora.fp8_fast_accumulation),
          "fp8 or fp8_compute: the forward's FP8 matmuls accumulate in the tensor cores' own precision, unpromoted "
          "(faster; torchao's Float8Linear default), the input gradient's stay promoted to fp32").shapes_model(),
      key("qlora.fp8_compute", "false", QTRAIN_FIELD(qlora.fp8_compute),
          "nf4 / fp4: the adapted projections multiply on FP8 tensor cores, each product dequantizing the 4-bit "
          "weight straight to e4m3 with a scale per row (QLoRA's memory, near the FP8 base's speed; one more "
          "rounding of the weights; Hopper / Ada, train.dtype bf16). quant: none (LoRA): the projections multiply "
          "on FP8 tensor cores from e4m3 rows of their 16-bit weights, quantized once; the 16-bit weights wait on "
          "the host for merges and exports (the FP8 base's memory and speed)").shapes_model(),
      key("qlora.llm_int8_threshold", "6.0", QTRAIN_FIELD(qlora.llm_int8_threshold),
          "int8: input features above this magnitude run in 16-bit")
          .at_least(0),
      key("qlora.skip_modules", "[lm_head]", QTRAIN_FIELD(qlora.skip_modules),
          "modules kept unquantized, by name pattern"),
  };
}

std::vector<RecipeKey> lora_keys() {
  return {
      key("lora.rank", std::to_string(qat::LoraOptions{}.rank), QTRAIN_FIELD(lora.rank),
          "adapter rank r; 0 trains the full weights instead (not with quant: qlora)").shapes_model()
          .at_least(0),
      key("lora.alpha", std::to_string(static_cast<int64_t>(qat::LoraOptions{}.alpha)), QTRAIN_FIELD(lora.alpha),
          "scaling numerator: alpha / r, or alpha / sqrt(r) with rslora")
          .above(0),
      key("lora.dropout", "0.0", QTRAIN_FIELD(lora.dropout),
          "dropout on the adapter input (peft's and Unsloth's default of 0 is the fast path; 0.05 costs ~8% of a step)")
          .at_least(0)
          .below(1),
      key("lora.rslora", "false", QTRAIN_FIELD(lora.rslora), "rank-stabilized scaling"),
      key("lora.use_dora", "false", QTRAIN_FIELD(lora.use_dora),
          "DoRA (peft's use_dora): a trained magnitude per output row rescales the adapted weight"),
      key("lora.target_modules", all_projections_yaml(), QTRAIN_FIELD(lora.target_modules),
          "modules that get adapters, by name pattern"),
      key("lora.init_from", "\"\"", QTRAIN_FIELD(lora.init_from),
          "PEFT adapter directory to start from; empty: fresh adapters")
          .path(),
  };
}

// data.pack_strategy's values: data/packing.h's table.
std::vector<std::string> pack_strategy_names() {
  std::vector<std::string> names;
  for (const auto& strategy : data::pack_strategies()) names.push_back(strategy.name);
  return names;
}

// qat.activations.format's values: every grid but gguf's blocks, which are weight formats.
std::vector<std::string> activation_format_names() {
  std::vector<std::string> names;
  for (const auto format : qat::quant_formats()) {
    if (qat::quant_format_info(format).kind != qat::GridKind::kGgufBlocks) names.emplace_back(qat::quant_format_name(format));
  }
  return names;
}

// qat.weights.gguf_type's values: llama.cpp's file types of blocks of integer codes.
std::vector<std::string> quantized_gguf_type_names() {
  std::vector<std::string> names;
  for (const auto& file_type : qat::gguf_file_types()) {
    if (qat::gguf_block_format(file_type.base_type).integer_codes) names.emplace_back(file_type.name);
  }
  return names;
}

// export.gguf_type's values: auto and llama.cpp's file types.
std::vector<std::string> gguf_type_names() {
  std::vector<std::string> names = {qat::kGgufFileTypeAuto};
  for (const auto& file_type : qat::gguf_file_types()) names.emplace_back(file_type.name);
  return names;
}

// export.scheme's values: auto and compressed-tensors' presets.
std::vector<std::string> compressed_tensors_scheme_names() {
  std::vector<std::string> names = {"auto"};
  for (auto& name : qat::quant_preset_names()) names.push_back(std::move(name));
  return names;
}

// The keys of one fake quantizer, qat.weights or qat.activations (the QuantizerRecipe `Quantizer`
// names): one list, where `pick` gives what the two say differently, the weights' first.
template <QuantizerRecipe QatRecipe::*Quantizer>
std::vector<RecipeKey> quantizer_keys() {
  constexpr bool weights = Quantizer == &QatRecipe::weights;
  const auto pick = [](auto for_weights, auto for_activations) { return weights ? for_weights : for_activations; };
  using Names = std::vector<std::string>;
  const std::string section = pick("qat.weights", "qat.activations");
#define QTRAIN_QUANTIZER_FIELD(member) [](Recipe& recipe) -> RecipeField { return &(recipe.qat.*Quantizer).member; }
  std::vector<RecipeKey> keys = {
      key(section + ".format", "int", QTRAIN_QUANTIZER_FIELD(format),
          pick("weight grid (gguf: llama.cpp's block types, .gguf_type)", "activation grid"))
          .shapes_model()
          .one_of(pick(all_names<qat::QuantFormat>(), activation_format_names())),
      key(section + ".bits", pick("4", "0"), QTRAIN_QUANTIZER_FIELD(bits),
          pick("integer width (format int)", "integer width (format int); 0: activations stay unquantized"))
          .shapes_model()
          .one_of(pick(Names{"2", "3", "4", "5", "6", "7", "8"}, Names{"0", "2", "3", "4", "5", "6", "7", "8"})),
      key(section + ".symmetric", pick("true", "false"), QTRAIN_QUANTIZER_FIELD(symmetric),
          pick("no zero point (symmetric int4 groups of 32 are GGUF Q4_0)", "no zero point"))
          .shapes_model(),
      key(section + ".granularity", pick("per_group", "per_token"), QTRAIN_QUANTIZER_FIELD(granularity),
          pick("weights sharing one scale", "activations sharing one scale"))
          .shapes_model()
          .one_of(pick(Names{"per_tensor", "per_channel", "per_group"}, Names{"per_tensor", "per_token", "per_group"})),
      key(section + ".group_size", "32", QTRAIN_QUANTIZER_FIELD(group_size),
          pick("input features per group (per_group)", "features per group (per_group)"))
          .shapes_model()
          .at_least(1),
      key(section + ".scale_dtype", "fp32", QTRAIN_QUANTIZER_FIELD(scale_dtype),
          pick("dtype the scales are rounded to and stored in (fp16: GGUF's Q4_0 / Q8_0)", "dtype the scales are rounded to"))
          .shapes_model()
          .one_of({"fp32", "fp16"}),
  };
  if (weights) {  // torchao's float zero point is a weight grid
    keys.push_back(
        key(section + ".zero_point_domain", "int", QTRAIN_QUANTIZER_FIELD(zero_point_domain),
            "float: each group's own [min, max] with a float zero point, torchao's int4 weight-only grid (symmetric: false)")
            .shapes_model()
            .one_of({"int", "float"}));
    std::vector<std::string> schemes = {""};
    for (auto& name : qat::trainable_quant_preset_names()) schemes.push_back(std::move(name));
    keys.push_back(
        key(section + ".scheme", "\"\"", QTRAIN_QUANTIZER_FIELD(scheme),
            "a compressed-tensors preset (W4A16, W8A8, FP8_DYNAMIC, ...: llm-compressor's names) that sets the weight and "
            "activation grids exactly as compressed-tensors rounds them, instead of the keys above; export.scheme auto "
            "writes it")
            .shapes_model()
            .one_of(schemes));
    keys.push_back(
        key(section + ".gguf_type", "Q4_K_M", QTRAIN_QUANTIZER_FIELD(gguf_type),
            "format gguf: llama.cpp's file type; each layer trains on the block type llama-quantize gives its tensor "
            "(Q4_K_M: Q4_K, and Q6_K for half the attn_v / ffn_down), and export.gguf_type auto writes that file type")
            .shapes_model()
            .one_of(quantized_gguf_type_names()));
  }
  std::vector<RecipeKey> observing = {
      key(section + ".observer", "dynamic", QTRAIN_QUANTIZER_FIELD(observer),
          pick("dynamic: scale from the current weights at every step; minmax, moving_average: running range",
               "dynamic: scale from each batch; minmax, moving_average: calibrated, then fixed"))
          .shapes_model()
          .one_of(pick(Names{"dynamic", "minmax", "moving_average"}, Names{"minmax", "moving_average", "dynamic"})),
      key(section + ".momentum", "0.01", QTRAIN_QUANTIZER_FIELD(momentum), "averaging constant of observer moving_average")
          .shapes_model()
          .above(0)
          .at_most(1),
      key(section + ".learned_scale", "false", QTRAIN_QUANTIZER_FIELD(learned_scale),
          pick("train the scale (LSQ); needs observer minmax or moving_average",
               "train the scale (LSQ), starting from the observer's"))
          .shapes_model(),
      key(section + ".learned_scale_init", "observer", QTRAIN_QUANTIZER_FIELD(learned_scale_init),
          pick("observer: the first scale from the observed range; paper: LSQ's 2 mean|w| / sqrt(Qp)",
               "observer: the first scale from the observed range; paper: LSQ's 2 mean|x| / sqrt(Qp)"))
          .shapes_model()
          .one_of({"observer", "paper"}),
  };
#undef QTRAIN_QUANTIZER_FIELD
  append(keys, std::move(observing));
  return keys;
}

std::vector<RecipeKey> qat_keys() {
  auto keys = quantizer_keys<&QatRecipe::weights>();
  append(keys, quantizer_keys<&QatRecipe::activations>());
  std::vector<RecipeKey> rest = {
      key("qat.base", "none", QTRAIN_FIELD(qat.base),
          "frozen base of QAT-LoRA: none (16-bit), or nf4 / fp4 / int8 kept as quant: qlora keeps it (qlora.blocksize, "
          "qlora.double_quant)").shapes_model()
          .one_of(base_names(&BaseQuantizationName::qat_base)),
      key("qat.lora_gradient", "identity", QTRAIN_FIELD(qat.lora_gradient),
          "the adapters' gradient through the weight quantizer: identity (LoRA's low-rank gradients) or masked "
          "(torchao's: the merged weight's gradient, zero where clipped)")
          .one_of({"identity", "masked"}),
      key("qat.start_step", "0", QTRAIN_FIELD(qat.start_step),
          "optimizer step at which fake quantization turns on")
          .at_least(0),
      key("qat.target_modules", all_projections_yaml(), QTRAIN_FIELD(qat.target_modules),
          "modules that get fake quantization, by name pattern").shapes_model(),
      key("qat.calibration_batches", "16", QTRAIN_FIELD(qat.calibration_batches),
          "qtrain quantize: training batches that calibrate static activation ranges (minmax, moving_average)")
          .at_least(0),
  };
  append(keys, std::move(rest));
  return keys;
}

std::vector<RecipeKey> data_keys() {
  return {
      key("data.train", "[]", QTRAIN_FIELD(data.train),
          "training data: files or directories of shards (JSONL, .txt, or llm.c .bin for tokens)")
          .path(),
      key("data.weights", "[]", QTRAIN_FIELD(data.weights),
          "share of each data.train source in the mixture; []: every sample once")
          .at_least(0),
      key("data.eval", "\"\"", QTRAIN_FIELD(data.eval),
          "held-out data in the same format; empty: no evaluation")
          .path(),
      key("data.format", "text", QTRAIN_FIELD(data.format),
          "text: {\"text\"}; instruct: alpaca fields, loss on the response; chat: {\"messages\"}; "
          "preference: {\"prompt\", \"chosen\", \"rejected\"} pairs (train.objective dpo, orpo, simpo); tokens: llm.c .bin")
          .one_of({"text", "instruct", "chat", "preference", "tokens"}),
      key("data.text_field", "text", QTRAIN_FIELD(data.text_field), "the JSONL field holding the text (format text)"),
      key("data.prompt_template", "alpaca", QTRAIN_FIELD(data.prompt_template),
          "instruct: a named template, or a template text with {instruction} and {input}"),
      key("data.train_on_inputs", "false", QTRAIN_FIELD(data.train_on_inputs),
          "instruct and chat: learn the prompt and every turn too, not only the responses"),
      key("data.chat_template", "\"\"", QTRAIN_FIELD(data.chat_template),
          "chat: the model's template when empty; a family name forces one (llama3, chatml, qwen3, "
          "qwen3-instruct, qwen3-thinking, mistral-v1, mistral-v3)"),
      key("data.max_seq_len", "2048", QTRAIN_FIELD(data.max_seq_len), "tokens per sequence")
          .at_least(2),
      key("data.overlong", "truncate", QTRAIN_FIELD(data.overlong),
          "instruct and chat samples over max_seq_len (text is cut into windows)")
          .one_of({"truncate", "drop"}),
      key("data.pack", "false", QTRAIN_FIELD(data.pack),
          "concatenate samples into full sequences; attention stays within each sample"),
      key("data.pack_strategy", "best_fit", QTRAIN_FIELD(data.pack_strategy),
          "best_fit: whole samples, each into the window it fills most closely; wrapped (text and tokens): "
          "windows filled to data.max_seq_len, a sample that does not fit continuing in the next window")
          .one_of(pack_strategy_names()),
      key("data.shuffle", "true", QTRAIN_FIELD(data.shuffle),
          "seeded shuffle of the examples each epoch"),
      key("data.skip_bad_records", "false", QTRAIN_FIELD(data.skip_bad_records),
          "skip (and count) malformed records instead of stopping"),
      key("data.prefetch_batches", "2", QTRAIN_FIELD(data.prefetch_batches),
          "batches prepared ahead on a background thread; 0: none")
          .at_least(0),
  };
}

std::vector<RecipeKey> optim_keys() {
  return {
      key("optim.name", "adamw", QTRAIN_FIELD(optim.name),
          "adamw: fp32 states; adamw8bit: blockwise 8-bit states")
          .one_of({"adamw", "adamw8bit", "sgd"}),
      key("optim.lr", "2e-4", QTRAIN_FIELD(optim.lr), "peak learning rate").above(0),
      key("optim.weight_decay", "0.0", QTRAIN_FIELD(optim.weight_decay), "decoupled weight decay")
          .at_least(0),
      key("optim.betas", "[0.9, 0.999]", QTRAIN_FIELD(optim.betas), "Adam's beta1, beta2")
          .at_least(0)
          .below(1)
          .of_length(2),
      key("optim.eps", "1e-8", QTRAIN_FIELD(optim.eps), "Adam's epsilon").above(0),
  };
}

std::vector<RecipeKey> schedule_keys() {
  return {
      key("schedule.name", "cosine", QTRAIN_FIELD(schedule.name), "learning rate after warmup")
          .one_of({"cosine", "linear", "constant"}),
      key("schedule.warmup_steps", "100", QTRAIN_FIELD(schedule.warmup_steps),
          "linear warmup from 0")
          .at_least(0),
      key("schedule.min_lr_ratio", "0.0", QTRAIN_FIELD(schedule.min_lr_ratio),
          "final learning rate as a fraction of optim.lr")
          .at_least(0)
          .at_most(1),
  };
}

std::vector<RecipeKey> train_keys() {
  std::string objectives;
  for (const auto& row : objective_rows()) objectives += (objectives.empty() ? "" : "; ") + row.name + ": " + row.doc;
  return {
      key("train.objective", "sft", QTRAIN_FIELD(train.objective), objectives).one_of(objective_names()),
      key("train.steps", "0", QTRAIN_FIELD(train.steps),
          "optimizer steps to run; 0: train.epochs passes over the data")
          .at_least(0),
      key("train.epochs", "1", QTRAIN_FIELD(train.epochs),
          "passes over the data (when train.steps is 0)")
          .at_least(0),
      key("train.micro_batch_size", "1", QTRAIN_FIELD(train.micro_batch_size),
          "sequences per forward pass, per rank")
          .at_least(1),
      key("train.grad_accum_steps", "1", QTRAIN_FIELD(train.grad_accum_steps),
          "micro-batches per optimizer step")
          .at_least(1),
      key("train.dtype", "bf16", QTRAIN_FIELD(train.dtype),
          "compute dtype; fp16 scales the loss dynamically")
          .one_of(kComputeDtypes),
      key("train.device", "auto", QTRAIN_FIELD(train.device), "auto: cuda when there is one")
          .one_of({"auto", "cpu", "cuda"}),
      key("train.seed", "42", QTRAIN_FIELD(train.seed),
          "seeds initialisation, dropout and shuffling")
          .at_least(0),
      key("train.max_grad_norm", "1.0", QTRAIN_FIELD(train.max_grad_norm),
          "clip the global gradient norm to this; 0: no clipping")
          .at_least(0),
      key("train.gradient_checkpointing", "false", QTRAIN_FIELD(train.gradient_checkpointing),
          "recompute decoder layers in backward instead of keeping their activations"),
      key("train.gradient_checkpointing_every", "1", QTRAIN_FIELD(train.gradient_checkpointing_every),
          "checkpoint every k-th decoder layer (1: all of them)")
          .at_least(1),
      key("train.loss_chunk_tokens", "0", QTRAIN_FIELD(train.loss_chunk_tokens),
          "tokens whose fp32 logits exist at once in the loss; 0: sized from the vocabulary")
          .at_least(0),
      key("train.fused_loss", "true", QTRAIN_FIELD(train.fused_loss),
          "the loss over vocabulary tiles with an online log-sum-exp: no [tokens, vocab] logits are kept; "
          "false: each chunk's whole logits, as transformers computes them"),
      key("train.memory", "auto", QTRAIN_FIELD(train.memory),
          "auto: on a GPU, also turn on the host-memory switches below that cost no measurable speed, where the run "
          "allows them (the run's first lines and inspect --recipe say which and why); manual: the switches as set")
          .one_of({"auto", "manual"}),
      key("train.offload_activations", "false", QTRAIN_FIELD(train.offload_activations),
          "with gradient checkpointing: keep each checkpointed layer's input in pinned host memory until its "
          "backward (copied on a side stream, fetched back one layer ahead)"),
      key("train.offload_branch_outputs", "false", QTRAIN_FIELD(train.offload_branch_outputs),
          "with train.offload_activations: each checkpointed layer's attention output (and, under Gemma's norms "
          "after each block, its MLP's) waits in pinned host memory too, and the recomputation reads it back instead "
          "of running the projection that made it: one more layer-input-sized copy each way per kept output"),
      key("train.mlp_chunk_tokens", "0", QTRAIN_FIELD(train.mlp_chunk_tokens),
          "run each MLP over chunks of this many tokens, each recomputed in backward, so no [tokens, intermediate] "
          "activation exists whole (long sequences); 0: the whole micro-batch at once")
          .at_least(0),
      key("train.keep_built_weights", "true", QTRAIN_FIELD(train.keep_built_weights),
          "with gradient checkpointing: a recomputed layer keeps the weights it dequantized (4-bit, int8, QAT's "
          "fake-quantized) for its backward; false: builds them again there (one layer's weights less memory)"),
      key("train.expert_bank_block_mb", "0", QTRAIN_FIELD(train.expert_bank_block_mb),
          "a mixture of experts' frozen 4-bit or MXFP4 expert bank built again in backward (train.keep_built_weights: "
          "false), and in the checkpointed forward where it is larger than this plus what backward holds beside it, "
          "is dequantized at most this many MB at a time (at least one expert), a block of whole experts "
          "at a time (the same products); 0: the whole bank (Qwen3-30B-A3B: 805 MB a layer)")
          .at_least(0)
          .at_most(1 << 20),
      key("train.embeddings_on_host", "false", QTRAIN_FIELD(train.embeddings_on_host),
          "keep the frozen input embedding table in host memory; only the rows a batch looks up go to the device "
          "(not a trained embedding; a tied one only with train.lm_head_on_host too, and it visits the device for the loss)"),
      key("train.lm_head_on_host", "false", QTRAIN_FIELD(train.lm_head_on_host),
          "keep the frozen lm_head weight in pinned host memory; each micro-batch copies it to the device on a "
          "side stream while the layers run forward, and lets go of the copy after the loss's backward (not a "
          "quantized, adapted or trained lm_head; a tied one with train.embeddings_on_host too)"),
      key("train.lm_head_block_mb", "0", QTRAIN_FIELD(train.lm_head_block_mb),
          "with train.lm_head_on_host and the fused loss: lm_head comes to the device a vocabulary tile at a time "
          "as the loss walks it, at most this many MB of it there at once (the tile in use and the next ones on "
          "their way; at least one tile, 64 MiB of fp32 logits wide), the first ones while the layers run "
          "forward; less memory at the loss, more of the copy in the step's time; 0: it visits whole")
          .at_least(0)
          .at_most(1 << 20),
      key("train.optimizer_states_on_host", "false", QTRAIN_FIELD(train.optimizer_states_on_host),
          "keep the optimizer's state (AdamW's moments, fp32 masters) in pinned host memory, a block per decoder "
          "layer; a step's update is applied in the next forward, each layer's just before the layer runs, its "
          "state in and out on side streams (the same updates, bit for bit)"),
      key("train.nonfinite", "skip", QTRAIN_FIELD(train.nonfinite),
          "a NaN/inf loss or gradient: skip the step, or abort the run")
          .one_of({"skip", "abort"}),
      key("train.max_skipped_steps", "10", QTRAIN_FIELD(train.max_skipped_steps),
          "skipped steps in a row after which the run stops (fp16 loss-scale backoffs count only below scale 1)")
          .at_least(1),
      key("train.empty_cache_steps", "0", QTRAIN_FIELD(train.empty_cache_steps),
          "release the CUDA cache every N steps; 0: never")
          .at_least(0),
      key("train.output_dir", "runs/qtrain", QTRAIN_FIELD(train.output_dir),
          "run directory: checkpoints, metrics.jsonl, exports")
          .path(),
  };
}

std::vector<RecipeKey> dpo_keys() {
  std::string loss_types;
  for (const auto& row : dpo_loss_type_rows()) loss_types += (loss_types.empty() ? "" : "; ") + row.name + ": " + row.doc;
  return {
      key("dpo.beta", "0.1", QTRAIN_FIELD(dpo.beta),
          "dpo: the KL weight; orpo: lambda, the log-odds term's weight; simpo: the reward scale (TRL's beta)")
          .above(0),
      key("dpo.loss_type", "sigmoid", QTRAIN_FIELD(dpo.loss_type), "dpo: " + loss_types)
          .one_of(dpo_loss_type_names()),
      key("dpo.label_smoothing", "0.0", QTRAIN_FIELD(dpo.label_smoothing),
          "dpo robust and simpo: the chance that a pair's preference label is wrong")
          .at_least(0)
          .below(0.5),
      key("dpo.simpo_gamma", "0.5", QTRAIN_FIELD(dpo.simpo_gamma), "simpo: the target reward margin gamma")
          .at_least(0),
      key("dpo.cpo_alpha", "1.0", QTRAIN_FIELD(dpo.cpo_alpha),
          "simpo: weight of the chosen completions' NLL (TRL's CPOConfig default; 0: SimPO as the paper)")
          .at_least(0),
      key("dpo.precompute_reference", "false", QTRAIN_FIELD(dpo.precompute_reference),
          "dpo: the reference's log-probabilities in one pass over the data before training (always so when "
          "training the full weights); false: each batch's, from the base with the adapters off"),
  };
}

std::vector<RecipeKey> checkpoint_keys() {
  return {
      key("checkpoint.every", "500", QTRAIN_FIELD(checkpoint.every),
          "save every N steps; 0: only at the end")
          .at_least(0),
      key("checkpoint.keep_last", "3", QTRAIN_FIELD(checkpoint.keep_last),
          "checkpoints kept; 0: all")
          .at_least(0),
  };
}

std::vector<RecipeKey> eval_keys() {
  return {
      key("eval.every", "500", QTRAIN_FIELD(eval.every),
          "evaluate every N steps; 0: only at the end (needs data.eval)")
          .at_least(0),
      key("eval.max_batches", "0", QTRAIN_FIELD(eval.max_batches),
          "eval batches per evaluation; 0: the whole eval split")
          .at_least(0),
  };
}

std::vector<RecipeKey> log_keys() {
  return {
      key("log.every", "10", QTRAIN_FIELD(log.every), "progress line and metrics every N steps")
          .at_least(1),
      key("log.tensorboard", "true", QTRAIN_FIELD(log.tensorboard),
          "TensorBoard event files in train.output_dir/tensorboard (the metrics of metrics.jsonl, the recipe as text)"),
  };
}

std::vector<RecipeKey> dist_keys() {
  return {
      key("dist.backend", "auto", QTRAIN_FIELD(dist.backend), "auto: nccl on GPUs, gloo on CPUs")
          .one_of({"auto", "nccl", "gloo"}),
      key("dist.timeout_s", "600", QTRAIN_FIELD(dist.timeout_s),
          "seconds a collective may wait before the run fails")
          .at_least(1),
      key("dist.bucket_mb", "25", QTRAIN_FIELD(dist.bucket_mb),
          "gradient all-reduce bucket size in MiB")
          .at_least(1),
      key("dist.reduce", "allreduce", QTRAIN_FIELD(dist.reduce),
          "allreduce: the backend sums the gradients; ordered: every rank gathers them and adds them in rank order, "
          "the bits of one process accumulating one micro-batch of each rank (world_size x the traffic)")
          .one_of({"allreduce", "ordered"}),
  };
}

std::vector<RecipeKey> export_keys() {
  return {
      key("export.formats", "[peft]", QTRAIN_FIELD(export_.formats),
          "written at the end of training and by `qtrain export`")
          .one_of(export_format_names()),
      key("export.out", "\"\"", QTRAIN_FIELD(export_.out),
          "export directory; empty: <train.output_dir>/export")
          .path(),
      key("export.gguf_type", "auto", QTRAIN_FIELD(export_.gguf_type),
          "gguf's llama.cpp file type (Q4_K_M, Q8_0, F16, ...: llama-quantize's names, the same bytes); auto: a QAT "
          "run's trained blocks, the rest F32")
          .one_of(gguf_type_names()),
      key("export.scheme", "auto", QTRAIN_FIELD(export_.scheme),
          "compressed-tensors' preset (W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, NVFP4A16); auto: a QAT run's "
          "qat.weights.scheme, W4A16 otherwise")
          .one_of(compressed_tensors_scheme_names()),
  };
}

// Every key, section by section, in the order --print-recipe shows them.
std::vector<RecipeKey> make_recipe_keys() {
  std::vector<RecipeKey> keys;
  for (const auto section : {model_keys, quant_keys, qlora_keys, lora_keys, qat_keys, data_keys, optim_keys,
                             schedule_keys, train_keys, dpo_keys, checkpoint_keys, eval_keys, log_keys, dist_keys, export_keys}) {
    append(keys, section());
  }
  return keys;
}

#undef QTRAIN_FIELD

}  // namespace

const EnumNames<QuantMethod>& enum_names(QuantMethod) {
  static const auto names = enum_names_from<QuantMethod>(
      quant_methods(), [](QuantMethod method) { return std::make_pair(method, quant_method_name(method)); });
  return names;
}

const EnumNames<BaseQuantization>& enum_names(BaseQuantization) {
  static const auto names = enum_names_from<BaseQuantization>(
      base_quantization_names(), [](const BaseQuantizationName& row) { return std::make_pair(row.kind, row.name); });
  return names;
}

const EnumNames<qat::QuantFormat>& enum_names(qat::QuantFormat) {
  static const auto names = enum_names_from<qat::QuantFormat>(qat::quant_formats(), [](qat::QuantFormat format) {
    return std::make_pair(format, qat::quant_format_name(format));
  });
  return names;
}

const std::vector<RecipeKey>& recipe_keys() {
  static const std::vector<RecipeKey> keys = make_recipe_keys();
  return keys;
}

std::optional<RecipeConflict> find_conflict(const Recipe& recipe) {
  if (recipe.quant == QuantMethod::kQlora && recipe.lora.rank == 0) {
    return RecipeConflict{"lora.rank",
                          "quant: qlora trains adapters on a frozen base, so lora.rank must be at "
                          "least 1 (quant: none or qat train the full weights with rank 0)"};
  }
  if (recipe.quant == QuantMethod::kQat && recipe.qat.base != BaseQuantization::kNone && recipe.lora.rank == 0) {
    const std::string base = base_quantization_name(recipe.qat.base);
    return RecipeConflict{"qat.base",
                          "qat.base: " + base + " keeps the base frozen in " + base +
                              ", so QAT trains adapters on it: set lora.rank to at least 1 (or qat.base: none "
                              "to train the full weights)"};
  }
  if (recipe.train.steps == 0 && recipe.train.epochs == 0) {
    return RecipeConflict{"train.epochs",
                          "train.steps and train.epochs are both 0: set how long to train"};
  }
  if (recipe.train.offload_branch_outputs && !recipe.train.gradient_checkpointing) {
    return RecipeConflict{"train.offload_branch_outputs",
                          "train.offload_branch_outputs keeps values for the recomputation of gradient checkpointing, "
                          "so it needs train.gradient_checkpointing: true"};
  }
  if (recipe.train.offload_activations && !recipe.train.gradient_checkpointing) {
    return RecipeConflict{"train.offload_activations",
                          "train.offload_activations moves the inputs that gradient checkpointing keeps to the host, "
                          "so it needs train.gradient_checkpointing: true"};
  }
  const std::pair<const char*, const QuantizerRecipe*> quantizers[] = {
      {"qat.weights", &recipe.qat.weights}, {"qat.activations", &recipe.qat.activations}};
  for (const auto& [section, quantizer] : quantizers) {
    const std::string prefix = section;
    if (quantizer->granularity == "per_token" && quantizer->observer != "dynamic") {
      return RecipeConflict{prefix + ".observer",
                            "'" + prefix + ".granularity: per_token' needs '" + prefix +
                                ".observer: dynamic' (each token's scale comes from that token), "
                                "got '" +
                                quantizer->observer + "'"};
    }
    if (quantizer->learned_scale && quantizer->observer == "dynamic") {
      return RecipeConflict{prefix + ".learned_scale",
                            "'" + prefix +
                                ".learned_scale: true' needs a fixed scale to learn: "
                                "set '" +
                                prefix + ".observer' to minmax or moving_average"};
    }
    if (quantizer->zero_point_domain == "float" && quantizer->symmetric) {
      return RecipeConflict{prefix + ".zero_point_domain",
                            "'" + prefix + ".zero_point_domain: float' (torchao's int4 weight-only grid) needs '" + prefix +
                                ".symmetric: false': its zero point is the offset of each group's own range"};
    }
  }
  const auto& formats = recipe.export_.formats;
  for (const auto& row : export_formats()) {
    const bool exported = std::find(formats.begin(), formats.end(), row.name) != formats.end();
    if (recipe.quant != QuantMethod::kQat && exported && !row.accepts(ExportedWeights::kFloat)) {
      return RecipeConflict{"export.formats", export_formats_refusing(ExportedWeights::kFloat) +
                                                  " write the weights on a QAT grid, so they need quant: qat (to "
                                                  "quantize a finished model, use qtrain quantize)"};
    }
  }
  const bool writes_gguf = std::any_of(formats.begin(), formats.end(), [](const std::string& name) {
    return find_export_format(name, "export.formats").format == ExportFormat::kGguf;
  });
  const bool writes_compressed_tensors = std::any_of(formats.begin(), formats.end(), [](const std::string& name) {
    return find_export_format(name, "export.formats").format == ExportFormat::kCompressedTensors;
  });
  if (recipe.export_.scheme != "auto" && !writes_compressed_tensors) {
    return RecipeConflict{"export.scheme", "export.scheme: " + recipe.export_.scheme +
                                               " names the scheme of a compressed-tensors export, but export.formats has "
                                               "none: add compressed-tensors"};
  }
  if (!recipe.qat.weights.scheme.empty()) {
    const auto& weights = recipe.qat.weights;
    if (recipe.quant != QuantMethod::kQat) {
      return RecipeConflict{"qat.weights.scheme", "qat.weights.scheme: " + weights.scheme +
                                                      " is a QAT grid, and quant is not qat: set quant: qat, or export the "
                                                      "finished model with export.scheme (post-training rounding)"};
    }
    // Every other qat.weights key at its default (the table's), activations off: the preset sets them.
    Recipe others_default = default_recipe();
    others_default.qat.weights = weights;
    others_default.qat.weights.scheme.clear();
    if (!(others_default == default_recipe()) || recipe.qat.activations.bits != 0) {
      return RecipeConflict{"qat.weights.scheme", "qat.weights.scheme: " + weights.scheme +
                                                      " sets the weight and activation grids itself (dynamic scales); "
                                                      "remove the other qat.weights keys and qat.activations.bits"};
    }
  }
  if (recipe.export_.gguf_type != qat::kGgufFileTypeAuto && !writes_gguf) {
    return RecipeConflict{"export.gguf_type", "export.gguf_type: " + recipe.export_.gguf_type +
                                                  " names the type of a GGUF export, but export.formats has none: add gguf"};
  }
  const auto& objective = find_objective(recipe.train.objective);
  if (objective.pairs != (recipe.data.format == "preference")) {
    return RecipeConflict{"train.objective",
                          objective.pairs ? "train.objective: " + objective.name +
                                                " trains on preference pairs: set data.format: preference "
                                                "({\"prompt\", \"chosen\", \"rejected\"} records)"
                                          : "data.format: preference holds pairs for a preference objective: set "
                                            "train.objective to dpo, orpo or simpo"};
  }
  if (objective.pairs && recipe.data.pack) {
    return RecipeConflict{"data.pack", "data.pack with train.objective " + objective.name +
                                           ": each row already holds one pair (chosen and rejected in one pass); "
                                           "pairs are not packed together yet, set data.pack: false"};
  }
  const bool smoothing_applies = (objective.objective == Objective::kDpo && recipe.dpo.loss_type == "robust") ||
                                 objective.objective == Objective::kSimpo;
  if (recipe.dpo.label_smoothing > 0 && !smoothing_applies) {
    return RecipeConflict{"dpo.label_smoothing",
                          "dpo.label_smoothing applies to dpo.loss_type robust and to simpo (TRL 1.16's sigmoid, ipo and "
                          "hinge ignore it): set dpo.loss_type: robust, or remove dpo.label_smoothing"};
  }
  if (recipe.quant == QuantMethod::kQat && !trains_full_weights(recipe) && recipe.lora.dropout > 0) {
    return RecipeConflict{"lora.dropout",
                          "quant: qat fake-quantizes the merged weight W + scale * B A, which has no place for "
                          "dropout on the adapters' input: set lora.dropout: 0"};
  }
  return std::nullopt;
}

const std::vector<std::pair<std::string, std::string>>& familiar_key_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"base_model", "model.path"},
      {"model_name_or_path", "model.path"},
      {"torch_dtype", "model.dtype"},
      {"r", "lora.rank"},
      {"lora_r", "lora.rank"},
      {"lora_alpha", "lora.alpha"},
      {"lora_dropout", "lora.dropout"},
      {"use_rslora", "lora.rslora"},
      {"lora_target_modules", "lora.target_modules"},
      {"bnb_4bit_quant_type", "qlora.quant_type"},
      {"bnb_4bit_use_double_quant", "qlora.double_quant"},
      {"llm_int8_skip_modules", "qlora.skip_modules"},
      {"llm_int8_threshold", "qlora.llm_int8_threshold"},
      {"sequence_len", "data.max_seq_len"},
      {"max_length", "data.max_seq_len"},
      {"sample_packing", "data.pack"},
      {"datasets", "data.train"},
      {"dataset", "data.train"},
      {"train_on_input", "data.train_on_inputs"},
      {"chat_template", "data.chat_template"},
      {"packed", "data.pack"},
      {"packing_strategy", "data.pack_strategy"},
      {"learning_rate", "optim.lr"},
      {"rl", "train.objective"},
      {"beta", "dpo.beta"},
      {"rl_beta", "dpo.beta"},
      {"loss_type", "dpo.loss_type"},
      {"label_smoothing", "dpo.label_smoothing"},
      {"simpo_gamma", "dpo.simpo_gamma"},
      {"cpo_alpha", "dpo.cpo_alpha"},
      {"precompute_ref_log_probs", "dpo.precompute_reference"},
      {"optimizer", "optim.name"},
      {"lr_scheduler", "schedule.name"},
      {"lr_scheduler_type", "schedule.name"},
      {"num_warmup_steps", "schedule.warmup_steps"},
      {"max_steps", "train.steps"},
      {"num_epochs", "train.epochs"},
      {"num_train_epochs", "train.epochs"},
      {"batch_size", "train.micro_batch_size"},
      {"per_device_train_batch_size", "train.micro_batch_size"},
      {"gradient_accumulation_steps", "train.grad_accum_steps"},
      {"max_grad_norm", "train.max_grad_norm"},
      {"enable_activation_checkpointing", "train.gradient_checkpointing"},
      {"save_steps", "checkpoint.every"},
      {"save_total_limit", "checkpoint.keep_last"},
      {"eval_steps", "eval.every"},
      {"logging_steps", "log.every"},
  };
  return names;
}

}  // namespace qtrain::trainer
