#pragma once
// The QAT model the export tests write: a fixture checkpoint (tiny-llama unless named) in fp32
// with every projection (the 7 of each layer, not lm_head) wrapped in a QatLinear of the given
// weight (and activation) scheme.
#include <optional>

#include "qat/qat_linear.h"
#include "support.h"
#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer::testing_qat {

// Multiplies every query and key by `query_key_scale` (the q / k projections and biases, or, where
// q / k norms follow them, those norms): the family fixtures' random weights attend almost
// uniformly, and under uniform attention a wrong rotary layout hardly shows in the logits.
inline void sharpen_attention(LoadedModel& loaded, double query_key_scale) {
  if (query_key_scale != 1.0) {
    torch::NoGradGuard no_grad;
    const auto& options = loaded.config.llama;
    const bool normed = options.query_key_norm;  // the norm undoes a scaled projection: scale after it
    for (auto& item : loaded.model->named_parameters()) {
      const auto& name = item.key();
      if (normed && (name.find("q_norm.") != std::string::npos || name.find("k_norm.") != std::string::npos)) {
        // Llama's x w, Gemma's x (1 + w): both come out query_key_scale times larger.
        auto& weight = item.value();
        weight.copy_(options.norm_style == NormStyle::kUnitOffset ? (weight + 1) * query_key_scale - 1 : weight * query_key_scale);
      } else if (!normed && (name.find("q_proj.") != std::string::npos || name.find("k_proj.") != std::string::npos)) {
        item.value().mul_(query_key_scale);
      } else if (!normed && name.find("qkv_proj.") != std::string::npos) {
        // Phi-3's fused rows: q's and k's, not v's.
        item.value().narrow(0, 0, (options.num_attention_heads + options.num_key_value_heads) * options.head_dim).mul_(query_key_scale);
      }
    }
  }
}

// `model_dir`'s model, attention sharpened (above), every linear layer fake-quantized.
inline LoadedModel qat_model_of(const std::string& model_dir, const qat::QuantSpec& weights,
                                const std::optional<qat::QuantSpec>& activations = std::nullopt,
                                double query_key_scale = 1.0) {
  auto loaded = load_llama(model_dir);
  sharpen_attention(loaded, query_key_scale);
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
