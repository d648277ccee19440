#pragma once
// What a run needs in device memory, from the model's shape and the recipe alone, before
// anything is loaded (`qtrain inspect`). Every figure follows what this code base allocates and
// what autograd keeps for backward, read off trainer/model/llama.cpp, qat/lora_linear.cpp,
// qat/four_bit_linear.cpp and trainer/model/causal_lm_loss.cpp; tests/trainer/model_memory_test.cpp
// checks them against the tensors of a real model and the bytes a real step allocates. The
// projections and the feed-forward block's activation are the blocks' own figures
// (attention_projections, trainer/model/feed_forward.h's row).
//
// Counted, with s = bytes of the compute dtype (train.dtype), T = micro_batch_size x seq tokens:
//
//   frozen weights   4-bit projections (qlora; not in qlora.skip_modules) as FourBitLinear keeps
//                    them: n/2 packed bytes, one absmax per block (1 byte when double-quantized,
//                    else fp32), the 16-entry code table, and with double quantization an fp32
//                    absmax per 256 blocks and the 256-entry nested table. An LLM.int8 base
//                    (qlora.quant_type int8) as Int8Linear keeps it: one int8 code per weight and
//                    an fp32 absmax per row. Everything else
//                    (embeddings, norms, lm_head, skipped or unquantized projections) in s bytes:
//                    the model is loaded in the compute dtype (model.dtype is not used). A
//                    compressed-tensors checkpoint under quant: none keeps the projections it
//                    quantizes in their stored form (stored_projection_bytes), and a recomputed
//                    layer keeps their dequantized weights as a 4-bit base's (below).
//   trainable state  16 bytes per trainable parameter: LoRA A and B are fp32, their fp32 grads,
//                    AdamW's two fp32 moments. With lora.rank 0 every weight trains: s-byte
//                    weight and grad, an fp32 master copy when s is 2, two fp32 moments: 16 again.
//                    The optimizer is taken to be AdamW whatever optim.name says.
//   activations      what autograd saves in the forward of one micro-batch, per decoder layer:
//                      both RMSNorms: their input in fp32 (4H) and the fp32 1/rms (4);
//                      the inputs the LoRA A matmuls save: the normed states (H s) for q/k/v and
//                      for gate/up, the SwiGLU product (I s) for down where its base does not
//                      fuse the adapter (LLM.int8; a fused one makes it again from gate and up),
//                      o reads the attention output, kept anyway; with lora.dropout > 0 each adapted projection keeps
//                      its own dropped input (in s) and mask (in bytes: bool on CUDA, s on the
//                      CPU) instead; the A outputs (rank s); the s-byte copies of A and B when s
//                      is 2; with lora.rank 0 the base matmuls save the same inputs and the norms
//                      their normed output (H s);
//                      nothing for a 4-bit or int8 base weight (dequantized again in backward);
//                      QAT-LoRA: the input (shared as LoRA's), A's output and B cast, or with
//                      quantized activations each projection's own quantized input and bool mask;
//                      attention: the fused kernels PyTorch 2.11 picks (cuDNN for bf16/fp16 on a
//                      Hopper GPU, flash on the CPU, memory-efficient for fp32 multi-head; flash
//                      on other GPUs keeps the same) save q, k, v, the output ((2 Q + 2 KV) s)
//                      and the fp32 logsumexp (4 heads), plus, with data.pack where flash
//                      attention's spans do not apply (the CPU, fp32, Gemma 2's soft cap), the
//                      mask as [batch, 1, seq, seq] in s bytes per layer; fp32 with grouped-query
//                      attention on CUDA falls to the math path, which keeps the softmax
//                      probabilities [batch, heads, seq, seq], q, k, v expanded to every head and
//                      a copy of its output for o_proj;
//                      SwiGLU: gate output, silu(gate), up output (3 I s), the product above;
//                    the first layer's input does not require grad (frozen embeddings), so its
//                    first RMSNorm and the q/k/v base matmuls keep nothing. Once per micro-batch:
//                    rotary cos and sin (2 head_dim s), the final RMSNorm (4H + 4), the bool mask
//                    of a packed batch written out (seq bytes, where the spans do not apply).
//                    With gradient checkpointing every k-th layer (index % k == 0) keeps only its
//                    input (H s); backward, walking down from the last layer, holds the layers
//                    below j plus layer j recomputed: the figure is the largest such sum. A
//                    recomputed layer keeps its built weights (dequantized 4-bit ones; QAT-LoRA's
//                    fake-quantized ones), out x in x s each, for its backward, unless
//                    train.keep_built_weights is false: then its backward builds them again one
//                    at a time, and the largest counts (an expert bank of a base that builds rows
//                    a block of whole experts at a time, train.expert_bank_block_mb). With
//                    train.offload_activations the checkpointed inputs wait on the host: on the
//                    device, only layer j's input
//                    and, fetched ahead, the one below it (2 H s). train.embeddings_on_host takes
//                    the input embedding table out of the frozen weights; train.lm_head_on_host
//                    takes lm_head out of them and adds it to the loss's moment below (an Error
//                    where lm_head is not a plain frozen weight, or is tied without
//                    train.embeddings_on_host). train.mlp_chunk_tokens is not
//                    modelled (an Error).
//   loss logits      the peak of causal_lm_loss for N = batch x (seq - 1) predicted tokens and
//                    vocabulary V, at the start of backward. train.fused_loss false: three fp32
//                    [N, V] tensors (the saved log-probabilities, the gradient of nll_loss and that
//                    of log_softmax), 12 N V bytes. Chunked by C < N tokens, the same for one
//                    chunk, 12 C V bytes, plus the [N, H] final states the checkpointed chunks
//                    keep (N H s).
//                    train.fused_loss true, where lm_head is a frozen plain weight (not LoRA'd,
//                    not trained, not LLM.int8) or the tied embeddings are frozen: the tiles of
//                    C x T (T = fused_loss_tile_columns(C, V)) in backward, one fp32 block with the
//                    softmax written in place, (4 + s) C T bytes when s < 4 (its matmul output,
//                    then its gradient, in the compute dtype), 4 C T in fp32, s C T more with a
//                    final logit cap (its tanh); the fp32 sum of the tiles' products and one
//                    product, C H (4 + s); the final states kept and their gradient (2 N H s);
//                    lse and the targets (12 N). The training step takes that pass in the forward
//                    instead (its gradient computed there, FusedLossOptions::gradient): the same
//                    tile, the fp32 [C, H] sum and a product, the states' gradient kept to
//                    backward; counted as the backward's. Measured on the CPU (tiny vocabulary, chunks of 16
//                    to 3072 tokens, tiles of 1000 to 8192 columns): within 1.2% of the loss's
//                    peak. No [C, V] block exists: at C = 1024, V = 128256, H = 4096 in bf16 the
//                    tiles (16384 columns) hold 96 MiB where the chunked path holds 1.5 GiB.
//
// Not counted: the CUDA context and cuBLAS/cuDNN workspaces (about 500 MiB on a GPU), the
// caching allocator's fragmentation and rounding, backward's transient gradients (a few
// [T, intermediate] tensors during each layer's backward), the dequantization's temporaries,
// the optimizer step's temporaries, with qat.lora_gradient masked the fp32 [out, in] gradient of
// one projection in backward. QAT-LoRA's weight build for one projection is counted
// (fake_quant_build_bytes), since on the CPU its temporaries are several fp32 copies of it.
//
// The total is the larger of two moments: the loss's backward (weights, state, everything the
// forward kept, the logits' peak, a host-kept lm_head's copy) and, with checkpointing, the layers' backward after it (the
// logits gone, one layer recomputed). So with checkpointing it can be less than the rows' sum.
//
// Accuracy: on the CPU, with the tiny model (tests/trainer/model_memory_test.cpp), the bytes a
// forward keeps come within 2% of `activations`, and the peak of a training step within 4% of
// the total, below or above. Not yet measured against a GPU step: there the caching allocator
// reserves more than tensors use (rounding, fragmentation), so expect the GPU's memory in use to
// exceed the total by that and the CUDA context. What autograd saves on CUDA (the attention
// kernel PyTorch picks, bool dropout masks) was checked on an H100. Sequences are taken at
// data.max_seq_len: batches of shorter samples (padded to their longest) need less.
#include <functional>
#include <string>
#include <vector>

#include "trainer/model/llama.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/recipe/base_quantization.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

struct LlamaParameterCounts {
  int64_t total = 0;
  int64_t projections = 0;  // the 7 linear layers of every decoder layer (what QLoRA quantizes)
  int64_t embeddings = 0;   // embed_tokens (+ lm_head when untied)
  int64_t norms = 0;
};

LlamaParameterCounts llama_parameter_counts(const LlamaOptions& options);

// How a run trains, as far as its memory goes. training_memory_setup() fills it from a recipe
// the way Finetune reads the recipe.
struct TrainingMemorySetup {
  // The frozen base (QLoRA's NF4 unless set): its kind, settings and skip_modules.
  BaseQuantizationSettings base{BaseQuantization::kNf4};
  bool full_finetune = false;    // lora.rank 0: every weight trains, no adapters
  // quant: qat with adapters (QAT-LoRA, qat/qat_lora_matmul.h): the adapted projections that
  // qat.target_modules names build their fake-quantized merged weight; with activations quantized
  // (qat.activations.bits > 0) each keeps its own quantized input and mask.
  bool fake_quantized = false;
  qat::LoraTargets fake_quantized_targets;
  bool activations_quantized = false;
  PeftAdapterConfig adapter;     // ranks, dropout and target modules of the adapters
  torch::ScalarType compute_dtype = torch::kBFloat16;
  torch::DeviceType device = torch::kCUDA;  // picks the attention kernel and the dropout mask's dtype
  int64_t micro_batch_size = 1;
  int64_t sequence_length = 2048;  // tokens per sequence (data.max_seq_len)
  bool packed = false;             // data.pack: every attention gets a block-diagonal mask
  bool gradient_checkpointing = false;
  int64_t checkpoint_every = 1;    // checkpoint decoder layers 0, k, 2k, ...
  int64_t loss_chunk_tokens = 0;   // <= 0: the whole micro-batch at once
  bool fused_loss = true;          // train.fused_loss: vocabulary tiles where lm_head is frozen
  bool offload_activations = false;  // train.offload_activations: checkpointed inputs on the host
  bool offload_branch_outputs = false;  // train.offload_branch_outputs: and the branch outputs (no device bytes)
  bool keep_built_weights = true;    // train.keep_built_weights
  int64_t expert_bank_block_bytes = 0;  // train.expert_bank_block_mb, in bytes; 0: banks build whole
  bool embeddings_on_host = false;   // train.embeddings_on_host: the input embedding table on the host
  bool lm_head_on_host = false;      // train.lm_head_on_host: lm_head on the device only for the loss
  int64_t lm_head_block_bytes = 0;   // train.lm_head_block_mb, in bytes: it visits in tiles; 0: whole
  bool optimizer_states_on_host = false;  // train.optimizer_states_on_host: AdamW's state on the host between steps
  // A pre-quantized checkpoint whose projections stay in their stored form under quant: none
  // (compressed-tensors: qat/compressed_linear.h): the bytes of projection `name` [out, in], or a
  // negative number where it is stored dense. Empty: every projection dense.
  std::function<double(const std::string& name, int64_t out, int64_t in)> stored_projection_bytes;
};

// quant, qlora.*, lora.* (or the adapter of lora.init_from), train.dtype, train.device ('auto':
// cuda), train.micro_batch_size, data.max_seq_len, data.pack, train.gradient_checkpointing[_every],
// train.loss_chunk_tokens (0: auto_loss_chunk_tokens of the vocabulary), train.fused_loss,
// train.offload_activations, train.keep_built_weights, train.embeddings_on_host,
// train.lm_head_on_host, train.lm_head_block_mb, train.optimizer_states_on_host, qat.*
// (quant: qat with adapters and a weight quantizer qat/qat_lora_matmul.h fuses; other QAT runs are
// an Error: not estimated).
TrainingMemorySetup training_memory_setup(const Recipe& recipe, const LlamaOptions& model);

struct PeakMemoryEstimate {
  double frozen_weight_bytes = 0;
  // train.lm_head_on_host: lm_head's weight, on the device from the forward to the loss's
  // backward (not in frozen_weight_bytes, which the layers' backward sees); under
  // train.lm_head_block_mb with the fused loss, the tiles of it there at once.
  double visiting_weight_bytes = 0;
  bool visits_in_tiles = false;      // train.lm_head_block_mb applies: the fused loss walks it once
  int64_t trainable_parameters = 0;
  int64_t adapted_layers = 0;        // linear layers with a LoRA adapter
  double trainable_state_bytes = 0;  // weights + grads + AdamW's moments (+ fp32 masters)
  // train.optimizer_states_on_host: the moments (and masters) of trainable_state_bytes, on the
  // host between steps; each decoder layer's share visits the device for its update in the next
  // forward (trainer/deferred_update.h), two layers' shares at a time: state_in_flight_bytes.
  double host_state_bytes = 0;
  double state_in_flight_bytes = 0;
  // train.offload_activations on a GPU: the pinned host memory the offload holds after the
  // forward, each checkpointed layer's input and, with train.offload_branch_outputs, its attention
  // output (and under Gemma's norms after each block its MLP's), until its backward.
  double offloaded_host_bytes = 0;
  double activation_bytes = 0;       // every layer keeps what its backward needs
  // With gradient checkpointing every checkpoint_every layers: the most alive while backward
  // walks the layers (one of them recomputed), and what the forward leaves for the loss's backward.
  double checkpointed_activation_bytes = 0;
  double checkpointed_saved_bytes = 0;
  // With checkpointing: the most one recomputed layer saves for its backward (its activations,
  // not the weights it builds). Backward holds it, the checkpointed forward does not.
  double recomputed_layer_bytes = 0;
  double logits_bytes = 0;           // the loss over the whole micro-batch at once
  double chunked_logits_bytes = 0;   // the loss in chunks (= logits_bytes when one chunk holds it all)
  double fused_loss_bytes = 0;       // the fused loss: one chunk's vocabulary tiles
  int64_t loss_chunk_tokens = 0;     // the chunk, or the micro-batch's predicted tokens when smaller
  int64_t loss_tile_columns = 0;     // the fused loss's vocabulary tile for that chunk
  int64_t predicted_tokens = 0;      // batch x (seq - 1)
  // [heads, seq, seq] scores kept: the math attention path (fp32 with GQA on CUDA), Gemma 2's soft
  // cap where its flash kernels do not apply
  bool attention_keeps_probabilities = false;
  bool uses_checkpointing = false;
  bool uses_chunking = false;  // the chunk is smaller than the micro-batch's predicted tokens
  bool fused_loss_applies = false;  // lm_head (or the tied embeddings) is a frozen plain weight
  bool uses_fused_loss = false;     // it applies and the setup asks for it
  // QAT-LoRA's builder for one projection (the largest) while it runs: on the CPU its torch
  // operations' fp32 temporaries, on CUDA the weight it writes (qat/qat_lora_matmul.cpp).
  double fake_quant_build_bytes = 0;

  // The peak: weights and trainable state, plus the larger of what the loss's backward needs on
  // top of the saved activations and what the layers' backward needs once the loss is done.
  double total() const;         // with the setup's own choices
  double lowest_total() const;  // with checkpointing, chunking and (where it applies) the fused loss
};

PeakMemoryEstimate estimate_peak_memory(const LlamaOptions& model, const TrainingMemorySetup& setup);

// The matmul weights one token passes through in a forward: every decoder projection (of an
// expert bank, its top-k experts' share), and the output head (a tied one through the table).
double active_matmul_weights(const LlamaOptions& model);

// What train.memory: auto weighs before putting lm_head or the optimizer's state on the host: the
// bytes each copies against the work they hide behind.
struct HostCopyWork {
  double lm_head_bytes = 0;    // an untied lm_head in the compute dtype, copied in each micro-batch
  double state_bytes = 0;      // AdamW's two fp32 moments of every trained parameter, out and back each step
  double flops_per_token = 0;  // 6 x the matmul weights a token passes through (a bank: its top-k experts)
};
HostCopyWork host_copy_work(const LlamaOptions& model, const Recipe& recipe);

// The weights and trainable state of four ways to train (`qtrain inspect --model`): qlora (NF4
// double-quantized, blocks of 64, lm_head kept), int8 (qlora on an LLM.int8 base, lm_head kept),
// lora (quant none) and full, all in bf16, with adapters of `lora_rank` on the 7 projections.
struct MemoryEstimate {
  std::string mode;  // qlora, int8, lora, full
  PeakMemoryEstimate estimate;
};
std::vector<MemoryEstimate> training_memory_estimates(const LlamaOptions& model, int64_t lora_rank);

}  // namespace qtrain::trainer
