#pragma once
// The QAT model the export tests write: a fixture checkpoint (tiny-llama unless named) in fp32
// with every projection (the 7 of each layer, not lm_head) wrapped in a QatLinear of the given
// weight (and activation) scheme.
#include <optional>

#include "qat/qat_linear.h"
#include "support.h"
#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer::testing_qat {

// `query_key_scale` multiplies the q / k projections (and biases) first: the family fixtures'
// random weights attend almost uniformly, and under uniform attention a wrong rotary layout
// hardly shows in the logits.
inline LoadedModel qat_model_of(const std::string& model_dir, const qat::QuantSpec& weights,
                                const std::optional<qat::QuantSpec>& activations = std::nullopt,
                                double query_key_scale = 1.0) {
  auto loaded = load_llama(model_dir);
  if (query_key_scale != 1.0) {
    torch::NoGradGuard no_grad;
    for (auto& item : loaded.model->named_parameters()) {
      if (item.key().find("q_proj.") != std::string::npos || item.key().find("k_proj.") != std::string::npos) {
        item.value().mul_(query_key_scale);
      }
    }
  }
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

inline LoadedModel tiny_qat_llama(const qat::QuantSpec& weights,
                                  const std::optional<qat::QuantSpec>& activations = std::nullopt) {
  return qat_model_of(testing::fixture("tiny-llama"), weights, activations);
}

}  // namespace qtrain::trainer::testing_qat
