#pragma once
// The llama.cpp architecture a model is written as in a GGUF file, from its family's row
// (ModelFamily::gguf, trainer/model/model_families.h): which one, its tensors' names, and what it
// cannot hold.
#include <string>

#include "trainer/formats/base_directory.h"
#include "trainer/formats/hf_config.h"

namespace qtrain::trainer {

// The architecture llama.cpp runs `config`'s model as; Error naming what it cannot hold (a sliding
// window shorter than the context, biases or norms it does not read, what it fixes otherwise).
const GgufArchitecture& gguf_architecture_for(const HfModelConfig& config);

// The GGUF name of a Hugging Face decoder tensor ("model.layers.3.self_attn.q_proj.weight" ->
// "blk.3.attn_q.weight") in llama.cpp's `architecture` (Gemma's name its sandwich norms their own
// way); Error naming it when llama.cpp's decoders have no such tensor.
std::string gguf_tensor_name(const std::string& hf_name, const std::string& architecture = "llama");

// `name` as general.name, rewritten where a family's GgufNameRule says llama.cpp would not load
// it with `base`'s tokenizer.
std::string gguf_general_name(std::string name, const BaseDirectory& base);

}  // namespace qtrain::trainer
