#pragma once
// One fake quantizer: a spec, where its scale comes from, and two switches (torch.ao's
// FakeQuantize). A QAT linear holds one for its weight and optionally one for its input.
//
// Where the scale comes from:
//   observer dynamic                   from each tensor as it passes (detached)
//   observer minmax / moving_average   from the observer's running range (observer.h)
//   learned_scale                      a Parameter `scale` trained with LSQ's gradient
//                                      (fake_quant.h), initialised at the first fake-quantized
//                                      forward: from the observer's range when it has one,
//                                      else from that tensor's min-max (`init observer`), or
//                                      as the LSQ paper does, 2 mean|x| / sqrt(Qp) (`init paper`);
//                                      the zero point (asymmetric specs) is taken from the
//                                      min-max then and kept.
// Switches: while the observer is enabled every forward updates it, whether or not fake quant
// is (so observers can run before `start_step`); while fake quant is disabled the forward
// returns its input unchanged.
//
// A weight's quantizer knows its shape (`fixed_shape`), so any granularity works. An
// activation's leading dimensions (batch, sequence) change from call to call, so an activation
// quantizer with an observer or a learned scale must be per_tensor; per-token scales are dynamic.
//
// State: `scale` (Parameter, learned only), `zero_point` and `scale_initialized` (buffers,
// learned only), the observer's `min_val` / `max_val` (child `observer`). A checkpoint must save
// these buffers as well as the parameters so that a resumed run continues with them.
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "qat/fake_quant.h"
#include "qat/gguf_grid.h"
#include "qat/observer.h"

namespace qtrain::qat {

enum class LearnedScaleInit { kObserver, kPaper };

struct FakeQuantizerOptions {
  QuantSpec spec;
  ObserverKind observer = ObserverKind::kDynamic;
  double momentum = kDefaultObserverMomentum;  // moving_average only
  bool learned_scale = false;
  LearnedScaleInit learned_scale_init = LearnedScaleInit::kObserver;
};

class FakeQuantizer : public torch::nn::Module {
 public:
  // Checks the options (Errors name `what`, the quantizer's recipe key, e.g. "qat.weights").
  // `fixed_shape`: the shape of every tensor this quantizer sees (a weight's), or empty.
  FakeQuantizer(const FakeQuantizerOptions& options, std::string what, std::vector<int64_t> fixed_shape = {});

  // x^ in x's dtype, with the straight-through (or LSQ) gradient; x itself while disabled.
  torch::Tensor forward(const torch::Tensor& x);

  void set_fake_quant_enabled(bool enabled) { fake_quant_enabled_ = enabled; }
  bool fake_quant_enabled() const { return fake_quant_enabled_; }
  void set_observer_enabled(bool enabled) { observer_enabled_ = enabled; }
  bool observer_enabled() const { return observer_enabled_; }

  // The scale and zero point the forward would use on x now, without observing or training
  // anything. An Error when a static quantizer has observed nothing.
  QuantParams current_qparams(const torch::Tensor& x) const;
  // x in its quantized form with current_qparams: what `convert` exports.
  QuantizedTensor quantize_tensor(const torch::Tensor& x) const;
  // Format gguf only: x (a 2-D weight) on the GGUF block type's grid, its codes and scales as
  // the blocks store them: what the forward's values are, and what a GGUF export writes.
  GgufGridTensor gguf_grid(const torch::Tensor& x) const;
  // Format gguf: round with llama.cpp's own quantizer (qat/gguf_quants.h, on the CPU: the bytes
  // llama-quantize writes) instead of the fast grid search on the weight's device. qtrain
  // quantize's PTQ rounds this way, so that it is llama-quantize's post-training quantization.
  void set_llama_cpp_rounding(bool enabled) { llama_cpp_rounding_ = enabled; }

  const FakeQuantizerOptions& options() const { return options_; }
  const QuantSpec& spec() const { return options_.spec; }
  const std::string& what() const { return what_; }
  // Learned scales only: the raw Parameter (effective_scale applies to it) and zero point.
  const torch::Tensor& learned_scale() const { return scale_; }
  const torch::Tensor& learned_zero_point() const { return zero_point_; }
  bool learned_scale_initialized() const;
  // Whether the quantizer has a scale to use now: dynamic, or its learned scale set or its static
  // range observed. A static quantizer without one cannot fake-quantize with its observer off.
  bool has_scale() const;
  // Sets the learned scale (and zero point) from x as the options say; the forward does it at
  // the first fake-quantized call.
  void initialize_learned_scale(const torch::Tensor& x);
  const std::shared_ptr<MinMaxObserver>& observer() const { return observer_; }
  void pretty_print(std::ostream& stream) const override;

 private:
  FakeQuantizerOptions options_;
  std::string what_;
  std::vector<int64_t> fixed_shape_;
  bool fake_quant_enabled_ = true;
  bool llama_cpp_rounding_ = false;
  bool observer_enabled_ = true;
  std::shared_ptr<MinMaxObserver> observer_;  // null for dynamic
  torch::Tensor scale_;              // learned only: fp32 Parameter, params shape
  torch::Tensor zero_point_;         // learned only: fp32 buffer of integers
  torch::Tensor scale_initialized_;  // learned only: bool [] buffer
};

}  // namespace qtrain::qat
