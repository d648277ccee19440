#pragma once
// Observers: where a static quantizer's range comes from. They watch tensors go by (the
// activations of calibration batches, or of the first training steps before fake quant is
// enabled) and keep a running per-block min and max, from which choose_qparams makes the scale
// and zero point (torch.ao's MinMaxObserver and MovingAverageMinMaxObserver):
//
//   minmax          min = min(min, min(x)), max = max(max, max(x))   over everything observed
//   moving_average  min = min + momentum * (min(x) - min), the same for max; the first
//                   observation is taken as it is
//
// `dynamic` is the absence of an observer: the range is taken from each tensor as it is
// quantized (weights, and per-token activations as in torchao's Int8DynActInt4Weight).
//
// The running range lives in buffers `min_val` / `max_val` (+inf / -inf before the first
// observation), so a training-state checkpoint that saves buffers carries it.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "qat/quantize.h"

namespace qtrain::qat {

enum class ObserverKind { kDynamic, kMinMax, kMovingAverage };

// "dynamic" | "minmax" | "moving_average"; anything else is an Error naming `what`.
ObserverKind parse_observer_kind(const std::string& name, const std::string& what);
const char* observer_kind_name(ObserverKind kind);

// torch.ao's default averaging constant.
constexpr double kDefaultObserverMomentum = 0.01;

class MinMaxObserver : public torch::nn::Module {
 public:
  // `params_shape`: the shape of the blocks' min / max, params_shape(spec, shape of what is
  // observed); [1] for a per-tensor activation. `kind` is minmax or moving_average;
  // `momentum` in (0, 1].
  MinMaxObserver(const QuantSpec& spec, std::vector<int64_t> params_shape, ObserverKind kind,
                 double momentum = kDefaultObserverMomentum);

  // Updates the range with x's block min / max (no gradient). An Error when x's blocks do not
  // have the observer's shape.
  void observe(const torch::Tensor& x);
  bool has_observed() const;
  // The scale and zero point of the range observed so far; an Error naming the spec when
  // nothing was observed yet.
  QuantParams qparams() const;

  const torch::Tensor& min_value() const { return min_value_; }
  const torch::Tensor& max_value() const { return max_value_; }
  ObserverKind kind() const { return kind_; }
  void pretty_print(std::ostream& stream) const override;

 private:
  QuantSpec spec_;
  ObserverKind kind_;
  double momentum_;
  torch::Tensor min_value_;  // fp32, params shape
  torch::Tensor max_value_;
};

}  // namespace qtrain::qat
