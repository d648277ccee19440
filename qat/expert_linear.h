#pragma once
// A bank of experts' weights for one projection of a mixture-of-experts block, and LoRA on it as
// peft adapts such a bank (its ParamWrapper on transformers' fused 3D expert parameters).
//
// The bank is an ordinary LinearLayer of `experts × out` rows by `in` columns: expert e's weight
// [out, in] is rows e·out ... (e+1)·out − 1, as transformers' [experts, out, in] parameter
// flattened. Every frozen-base kind (NF4, FP4, int8, FP8 rows) quantizes it as it quantizes any
// projection, with the same bytes it would give the 3D tensor (bitsandbytes flattens it too).
// It is never multiplied whole: grouped_linear multiplies each expert's rows of a token batch
// sorted by expert by that expert's weight alone.
//
// ExpertLora adds peft's per-expert update, with scale = alpha / rank (alpha / sqrt(rank) with
// rsLoRA):
//
//     W'_e = W_e + scale · B_e A_e,   A [experts · rank, in], A_e = A[e·rank : (e+1)·rank]
//                                     B [out, rank · experts], B_e = B[:, e :: experts]
//
// (A expert-major, B rank-major: the layouts peft saves). The update runs on the activations,
// (x A_e^T) B_e^T per expert, as two more grouped products: peft merges it into the weight
// instead; the two agree to rounding.
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qat/linear.h"
#include "qat/lora_options.h"

namespace qtrain::qat {

// rows [tokens, in], sorted by expert; counts [experts] int64 (how many rows each expert takes,
// on the rows' device); weights [experts, out, in] -> [tokens, out]. On a CUDA device in bf16 /
// fp16 with dimensions of whole 16-byte rows, one grouped GEMM (torch's _grouped_mm, no host
// synchronisation); elsewhere one matmul per expert that has rows (the CPU's exact path).
torch::Tensor grouped_linear(const torch::Tensor& rows, const torch::Tensor& weights, const torch::Tensor& counts);

// A module whose children include expert banks (trainer/model/sparse_moe.h) says how many experts
// each holds, so that apply_lora gives them ExpertLora instead of LoraLinear. 0: not a bank.
class ExpertBankOwner {
 public:
  virtual ~ExpertBankOwner() = default;
  virtual int64_t bank_experts(const std::string& child_name) const = 0;
};

// Every expert bank under `root`, by its dotted name ("model.layers.0.mlp.experts.gate_up_proj"),
// with the experts it holds: what apply_lora, the peft writer and the recipe's checks ask.
std::map<std::string, int64_t> expert_banks(const torch::nn::Module& root);

// The bank's weights as [experts, out, in] in `dtype`, as its forward multiplies them (a
// dequantization for quantized bases).
torch::Tensor expert_weights(const LinearLayer& bank, int64_t experts, torch::ScalarType dtype);

// rows times the bank's experts, grouped_linear over expert_weights. A frozen bank whose weights
// are built (a quantized base: matmul_weight_kind() not kStored) keeps them for backward only
// where KeepBuiltWeights is active (a checkpointed layer's recomputation, qat/linear.h); elsewhere
// backward builds them again, as the frozen 4-bit layers do, so a layer keeps no dequantized bank
// (Qwen3-30B-A3B: 1.2 GB of bf16 a layer). A bank built again, or built for a product without
// grad (a checkpointed forward) and larger than WholeBanksWithoutGrad allows, is built in blocks
// where BuildBanksInBlocks asks it (qat/linear.h): a few whole experts at a time, each
// multiplying its own rows (the counts come to the host once, at the forward).
torch::Tensor bank_product(const LinearLayer& bank, int64_t experts, const torch::Tensor& rows, const torch::Tensor& counts);
// bank_product where nothing reads the output's values, only its place in autograd's graph (a
// checkpointed layer's recomputation: the experts' down products, weighed before, join the residual
// stream that is the layer's output). The values are left unwritten and the bank is built only in
// backward, for the rows' gradient. A bank that trains, or a product without grad, is bank_product.
torch::Tensor bank_product_for_graph(const LinearLayer& bank, int64_t experts, const torch::Tensor& rows,
                                     const torch::Tensor& counts);
// How many of a bank's `experts` (each `expert_bytes` built) one block of BuildBanksInBlocks'
// `block_bytes` holds: as many as fit, at least one; all of them for 0. The memory estimate
// (trainer/recipe/model_memory.cpp) counts the same blocks.
int64_t experts_per_block(int64_t experts, int64_t expert_bytes, int64_t block_bytes);
// `counts` [experts] on the host, as int64: one copy (a device sync) per counts tensor on this
// thread, so a layer's gate_up and down banks built in blocks share it; a counts tensor changed in
// place since is copied again.
std::vector<int64_t> host_counts(const torch::Tensor& counts);

class ExpertLora : public LinearLayer {
 public:
  // `base` [experts × out, in] becomes the frozen child `base_layer`. peft's ParamWrapper trains
  // no dropout, DoRA or bias: options asking for them are an Error.
  ExpertLora(std::shared_ptr<LinearLayer> base, int64_t experts, const LoraOptions& options);
  // peft's initialisation: A kaiming-uniform (a = sqrt(5)), B zero.
  void reset();

  // rows sorted by expert, counts as grouped_linear's -> [tokens, out]. `output_unread`: the
  // base's product is bank_product_for_graph's (nothing reads the output's values).
  torch::Tensor grouped_forward(const torch::Tensor& rows, const torch::Tensor& counts, bool output_unread = false);
  // A bank has no product over all of its rows.
  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return base_->in_features(); }
  int64_t out_features() const override { return base_->out_features(); }
  // [experts × out, in]: W_e + scale B_e A_e for every expert, in fp32, returned in `dtype`.
  torch::Tensor dense_weight(torch::ScalarType dtype) const override;
  torch::Tensor bias() const override { return base_->bias(); }
  void pretty_print(std::ostream& stream) const override;

  int64_t experts() const { return experts_; }
  const LoraOptions& options() const { return options_; }
  double scale() const { return scale_; }
  const std::shared_ptr<LinearLayer>& base_layer() const { return base_; }
  // Registered as `lora_A.weight` / `lora_B.weight`, peft's names.
  const torch::Tensor& lora_A() const { return lora_A_->weight; }  // [experts × rank, in], fp32
  const torch::Tensor& lora_B() const { return lora_B_->weight; }  // [out, rank × experts], fp32

 private:
  std::shared_ptr<LinearLayer> base_;
  int64_t experts_;
  LoraOptions options_;
  double scale_;
  torch::nn::Linear lora_A_{nullptr}, lora_B_{nullptr};
};

}  // namespace qtrain::qat
