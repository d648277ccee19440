#pragma once
// y = x W^T + b + scale * (x A^T) B^T for a frozen base layer that multiplies by a dense weight
// W (stored, or a dequantized 4-bit one), as one autograd node. The scaled update is written by
// its rank-r matmul (alpha = scale) and the base's matmul accumulates onto it (beta = 1); backward
// builds the input gradient the same way: no separate update tensor, scale multiply or adds,
// which autograd's composition of the same operations spent 20% of an 8B LoRA step on. A 4-bit W is dequantized again for backward unless KeepBuiltWeights is
// active (a checkpointed layer's recomputation), as bitsandbytes' MatMul4Bit does.
//
// A base that multiplies itself (FP8: LinearLayer::multiplies_itself) writes its own product
// first and the rank-r matmul accumulates onto it (beta = 1), forward and backward (with dropout,
// backward adds the base's share to the masked update instead).
//
// Numerics: peft's order (x A^T first, then B), in the input's dtype with fp32 accumulation; the
// update is scaled in fp32 inside its matmul instead of after rounding it, so results differ from
// the unfused reference by rounding only (tests/qat/lora_matmul_test.cpp states the tolerance).
#include <torch/torch.h>

#include <memory>

#include "qat/linear.h"

namespace qtrain::qat {

struct LoraMatmulOptions {
  double scale = 1.0;  // the update's factor: alpha / rank (alpha / sqrt(rank) with rsLoRA)
  // > 0: peft's dropout on the adapter's input only (a fresh mask each call; 0 in eval).
  double dropout = 0.0;
  // If given, makes `input` again bit for bit (LinearLayer::forward_rebuilding_input): backward
  // calls it for A's gradient instead of keeping the input from forward.
  LinearLayer::InputRebuild rebuild_input;
  // LinearLayer::forward_for_graph: nothing reads the output's values, so they are left unwritten
  // and neither product runs (backward reads x, x A^T and W, never y); what backward keeps, the
  // dropout mask drawn and the gradients are those of the product computed. Without dropout and
  // with rebuild_input, backward makes x A^T from the rebuilt input too: the forward reads no value
  // of `input` (LinearLayer::reads_input_for_graph), and x A^T is the same product on the same bits.
  bool output_unread = false;
};

// input [..., in]; base: a layer with matmul_weight_kind() != kNone or that multiplies itself, frozen; lora_A [rank, in],
// lora_B [out, rank] (any float dtype; gradients come back in theirs) -> [..., out] in input's dtype.
torch::Tensor lora_matmul(const torch::Tensor& input, const std::shared_ptr<LinearLayer>& base,
                          const torch::Tensor& lora_A, const torch::Tensor& lora_B, const LoraMatmulOptions& options);

}  // namespace qtrain::qat
