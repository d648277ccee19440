#pragma once
// y = x W^T for a frozen 4-bit W, as bitsandbytes' MatMul4Bit: W is dequantized for the
// forward matmul and again for backward's x-gradient (grad_y W), never kept in between (on CUDA
// each dequantization is one kernel, straight into the compute dtype: qat/four_bit_codec.h). Left
// to autograd, F::linear would save the dequantized [out, in] weight of every projection until
// backward: 13 GiB of bf16 copies for a Llama-3-8B step, more than its 4-bit base.
#include <torch/torch.h>

#include "qat/four_bit_codec.h"

namespace qtrain::qat {

// x [..., in] in the compute dtype -> [..., out] in x's dtype. The weight gets no gradient.
torch::Tensor four_bit_matmul(const torch::Tensor& input, const torch::Tensor& packed, const FourBitQuantState& state);

}  // namespace qtrain::qat
