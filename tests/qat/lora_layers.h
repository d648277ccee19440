#pragma once
// The layers the qat tests build: a dense base, an NF4 one, LoRA's options in one line, and an
// adapter whose B is not zero (peft starts B at zero, and a test of the update needs one that is not).
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "qat/four_bit_linear.h"
#include "qat/lora_linear.h"

namespace qtrain::qat::test_layers {

// A [out, in] layer with torch's initialisation, and a bias when `bias`.
inline std::shared_ptr<DenseLinear> dense(int64_t in, int64_t out, bool bias = true,
                                          torch::ScalarType dtype = torch::kFloat32) {
  return std::make_shared<DenseLinear>(DenseLinearOptions{in, out, bias, dtype});
}

// An NF4 base of a fresh random [out, in] weight (scaled as trained weights are), computing in fp32.
inline std::shared_ptr<FourBitLinear> fp32_four_bit_base(int64_t out, int64_t in) {
  FourBitOptions options;
  options.compute_dtype = torch::kFloat32;
  return FourBitLinear::from_dense(torch::randn({out, in}) * 0.05, torch::Tensor(), options);
}

inline LoraOptions lora_options(int64_t rank, double alpha, double dropout = 0.0, bool rslora = false) {
  LoraOptions options;
  options.rank = rank;
  options.alpha = alpha;
  options.dropout = dropout;
  options.rslora = rslora;
  return options;
}

// `lora`'s B drawn from N(0, deviation^2), as training would leave it.
inline void randomise_B(LoraLinear& lora, double deviation) {
  torch::NoGradGuard no_grad;
  lora.lora_B().normal_(0.0, deviation);
}

// An adapter with `options` over `base`, its B drawn from N(0, b_std^2).
inline std::shared_ptr<LoraLinear> lora_over(std::shared_ptr<LinearLayer> base, const LoraOptions& options,
                                             double b_std) {
  auto lora = std::make_shared<LoraLinear>(std::move(base), options);
  randomise_B(*lora, b_std);
  return lora;
}

}  // namespace qtrain::qat::test_layers
