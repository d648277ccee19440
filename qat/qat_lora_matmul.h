#pragma once
// QAT of a LoRA layer as one autograd node, without an fp32 copy of its merged weight:
//
//     y = x fq(W0 + scale * B A)^T + b
//
// W0 the frozen base as the LoRA forward multiplies by it (a 16-bit weight as stored, a 4-bit
// one dequantized to the dtype it was quantized from), fq the weight quantizer's integer grid with
// scales taken from the merged weight as it is (observer dynamic). The merged weight is built,
// blocked and rounded in one pass (kernels/merged_fake_quantize.h on CUDA; the same fp32
// operations in the same order as torch operations on the CPU, so both give the same bits), and
// convert() and every export read the same builder: the exported codes dequantize bit for bit to
// the weight the last forward multiplied by.
//
// The gradient of A and B (`qat.lora_gradient`), with G = dL/dy and X the input rows:
//   identity  the straight-through estimator through the whole grid, dL/dM = X^T G: the factors
//             get LoRA's low-rank gradients, dL/dB = scale G^T (X A^T), dL/dA = scale (G B)^T X
//             (a [tokens, r] product instead of a [out, in] one). The default: the plain LoRA
//             backward plus one build of the weight.
//   masked    torchao's: dL/dM = (G^T X) masked where the value was clipped (quantize.h's
//             `inside`), projected onto the factors, dL/dB = scale dL/dM A^T, dL/dA = scale B^T
//             dL/dM. It costs the [out, in] weight-gradient matmul a frozen base never needs.
// They differ only where a value is clipped: for a symmetric grid, at most the largest positive
// value of a block (absmax / s = quant_max + 0.5 rounds past the grid's end); asymmetric grids
// map both ends inside.
// The input's gradient is G fq(M) either way. The weight is built again for backward unless
// qat::KeepBuiltWeights is active (a checkpointed layer's recomputation keeps it, one layer's worth).
#include <torch/torch.h>

#include <memory>
#include <string>

#include "qat/fake_quantizer.h"
#include "qat/lora_linear.h"
#include "qat/quantize.h"

namespace qtrain::qat {

enum class LoraGradient { kIdentity, kMasked };

// "identity" | "masked"; anything else is an Error naming `what`.
LoraGradient parse_lora_gradient(const std::string& name, const std::string& what);
const char* lora_gradient_name(LoraGradient gradient);

// Whether this path applies: LoRA without DoRA over a 16-bit or 4-bit base (DenseLinear,
// FourBitLinear), and a weight quantizer on an integer grid with an integer zero point, per_group
// or per_channel, observer dynamic, no learned scale. Other QAT layers take QatLinear's autograd
// composition.
bool fuses_merged_fake_quant(const LoraLinear& lora, const FakeQuantizerOptions& weights);
// The quantizer's half of that test.
bool quantizer_fuses_merge(const FakeQuantizerOptions& weights);

struct MergedFakeQuant {
  torch::Tensor values;      // [out, in] in the asked dtype: what the forward multiplies by
  QuantizedTensor quantized; // codes (when asked), scales and zero points; its spec
  torch::Tensor inside;      // [out, in] bool when asked: the masked gradient's mask
};

// The merged weight of `lora` fake-quantized on `spec`'s grid (fuses_merged_fake_quant holds).
MergedFakeQuant fake_quantize_merged(const LoraLinear& lora, const QuantSpec& spec, torch::ScalarType values_dtype,
                                     bool values, bool codes, bool inside);

// y = x fq(W0 + scale B A)^T + b (above); input [..., in] -> [..., out] in input's dtype.
torch::Tensor qat_lora_matmul(const torch::Tensor& input, const std::shared_ptr<LoraLinear>& lora, const QuantSpec& spec,
                              LoraGradient gradient);

}  // namespace qtrain::qat
