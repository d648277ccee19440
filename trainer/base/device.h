#pragma once
#include <string>

#include <torch/torch.h>

namespace qtrain::trainer {

// "cpu", "cuda", "cuda:N" or "auto" (CUDA when a GPU is visible) -> a device; a CUDA device
// that is not there is an Error that says what to use instead. "cuda" and "auto" mean GPU
// `local_rank`: under a launcher each process of a node takes its own GPU. A CUDA device
// becomes the current one, where kernels and collectives without a device of their own go.
torch::Device resolve_device(const std::string& name, int64_t local_rank = 0);

}  // namespace qtrain::trainer
