#pragma once
// Switching the adapters off for a scope, as peft's `with model.disable_adapter():` does: while an
// AdaptersOff lives on this thread, every LoRA layer (qat/lora_linear.h, the experts' banks of
// qat/expert_linear.h, QAT's merged path) computes its base layer alone. A preference objective's
// reference model is the base this way, at no memory cost.
namespace qtrain::qat {

bool adapters_enabled();

class AdaptersOff {
 public:
  AdaptersOff();
  ~AdaptersOff();
  AdaptersOff(const AdaptersOff&) = delete;
  AdaptersOff& operator=(const AdaptersOff&) = delete;

 private:
  bool previous_;
};

}  // namespace qtrain::qat
