#include "trainer/model/attention_backends.h"

#include <ATen/Context.h>

namespace qtrain::trainer {

WithoutCudnnAttention::WithoutCudnnAttention() : was_enabled_(at::globalContext().userEnabledCuDNNSDP()) {
  at::globalContext().setSDPUseCuDNN(false);
}

WithoutCudnnAttention::~WithoutCudnnAttention() { at::globalContext().setSDPUseCuDNN(was_enabled_); }

}  // namespace qtrain::trainer
