// Config variants (GQA/MQA, biases, tied embeddings, rope default/linear/dynamic/llama3,
// fp32/bf16/fp16 storage, sharded safetensors, transformers 4.x and 5.x config keys) against
// transformers itself: tests/interop/llama_variants.py builds each model and its fp32 logits.
// One test for all of them: building the references costs one Python start.
#include <gtest/gtest.h>

#include "support.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {
namespace {

TEST(LlamaVariants, LogitsEqualTransformersInFp32) {
  const auto lacks = testing::python_lacks("torch transformers safetensors");
  if (!lacks.empty()) GTEST_SKIP() << lacks;
  testing::TempDir directory;
  const auto built = testing::run_interop_script("llama_variants.py", directory.path());
  ASSERT_EQ(built.status, 0) << built.output;
  for (const char* variant : {"gqa_bias_tied_v4", "mqa_llama3_sharded", "linear_rope_fp16_v4", "dynamic_rope"}) {
    SCOPED_TRACE(variant);
    const auto model_dir = directory.file(variant);
    auto loaded = load_llama(model_dir);
    auto reference = SafetensorsFile::open(model_dir + "/reference.safetensors");
    torch::NoGradGuard no_grad;
    auto logits = loaded.model->forward({reference.tensor("input_ids"), {}, {}});
    auto expected = reference.tensor("logits");
    ASSERT_EQ(logits.sizes(), expected.sizes());
    const double error = (logits - expected).abs().max().item<double>() / expected.abs().max().item<double>();
    EXPECT_LE(error, 1e-5);
  }
}

}  // namespace
}  // namespace qtrain::trainer
