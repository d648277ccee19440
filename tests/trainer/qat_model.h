#pragma once
// The QAT model the export tests write: tiny-llama in fp32 with every projection (the 7 of each
// layer, not lm_head) wrapped in a QatLinear of the given weight (and activation) scheme.
#include <optional>

#include "qat/qat_linear.h"
#include "support.h"
#include "trainer/hf_checkpoint.h"

namespace qtrain::trainer::testing_qat {

inline LoadedModel tiny_qat_llama(const qat::QuantSpec& weights,
                                  const std::optional<qat::QuantSpec>& activations = std::nullopt) {
  auto loaded = load_llama(testing::fixture("tiny-llama"));
  qat::QatLinearOptions options;
  options.weights.spec = weights;
  if (activations) {
    qat::FakeQuantizerOptions activation_options;
    activation_options.spec = *activations;
    options.activations = activation_options;
  }
  qat::LoraTargets targets;
  targets.include.names = {"all-linear"};
  qat::apply_qat(*loaded.model, targets, options);
  loaded.model->eval();
  return loaded;
}

}  // namespace qtrain::trainer::testing_qat
