#pragma once
// The linear layers a model is built from. Every projection of the Llama model is a
// `LinearLayer`, so QLoRA, LLM.int8 and QAT swap in their own kind (a frozen 4-bit base, an
// adapter around it) without the model knowing which one it holds.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace qtrain::qat {

class LinearLayer : public torch::nn::Module {
 public:
  // input [..., in_features] -> [..., out_features], in the input's dtype
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  // forward(input) for an input that `rebuild` makes again, bit for bit, from tensors autograd
  // keeps anyway (an MLP's product from its gate and up): a layer whose backward would keep
  // `input` may keep `rebuild` instead and call it there. Most layers just run forward(input).
  using InputRebuild = std::function<torch::Tensor()>;
  virtual torch::Tensor forward_rebuilding_input(const torch::Tensor& input, const InputRebuild& rebuild) {
    (void)rebuild;
    return forward(input);
  }
  // forward_rebuilding_input(input, rebuild) where nothing will read the output's values, only
  // its place in autograd's graph: a block's last projection in a checkpointed layer's
  // recomputation, whose output only joins the residual stream that is the layer's output (the
  // sum's backward reads no values). A layer whose backward does not need its output either (a
  // LoRA adapter on a frozen base: qat/lora_matmul.h) may leave the values unwritten and skip the
  // base's product; the rest compute it as usual.
  virtual torch::Tensor forward_for_graph(const torch::Tensor& input, const InputRebuild& rebuild) {
    return forward_rebuilding_input(input, rebuild);
  }
  // Whether forward_for_graph(input, rebuild), given a rebuild, reads any value of `input`. A layer
  // that does not (LoRA on a frozen matmul base without dropout: backward makes x A^T from the
  // rebuilt input) lets its caller leave the input unwritten too (an MLP's gated product).
  virtual bool reads_input_for_graph() const { return true; }
  virtual int64_t in_features() const = 0;
  virtual int64_t out_features() const = 0;
  // The weight as a dense [out_features, in_features] tensor in `dtype` (what a merge or an
  // export needs); quantized layers dequantize.
  virtual torch::Tensor dense_weight(torch::ScalarType dtype) const = 0;
  virtual torch::Tensor bias() const = 0;  // undefined tensor when the layer has none

  // Layers whose forward is x W^T + b for a weight they can hand out in the compute dtype say
  // how they hold it, so that an adapter around them (qat/lora_matmul.h) can fuse its update
  // into their matmuls: kStored hands out the stored tensor (no copy in its own dtype), kBuilt
  // makes it for each call (a dequantization). kNone: forward multiplies otherwise (LLM.int8).
  enum class MatmulWeight { kNone, kStored, kBuilt };
  virtual MatmulWeight matmul_weight_kind() const { return MatmulWeight::kNone; }
  // W [out, in] in `dtype` as forward multiplies by it; an Error for kNone.
  virtual torch::Tensor matmul_weight(torch::ScalarType dtype) const;

  // A layer that multiplies in its own format (FP8 tensor cores: qat/float8_linear.h) says so, and
  // an adapter around it (qat/lora_matmul.h) takes the base's share of its forward and backward
  // from the two products below instead of from matmul_weight.
  virtual bool multiplies_itself() const { return false; }
  // rows [tokens, in] -> rows W^T [tokens, out] (no bias), and grad_rows [tokens, out] ->
  // grad_rows W [tokens, in], in the rows' dtype, without autograd; an Error unless multiplies_itself.
  // `onto`, if defined (contiguous, the result's shape and dtype), is what the product is added
  // onto, in place, and returned: an adapter writes its rank-r share first and the large product
  // accumulates onto it, with no second pass over the output.
  virtual torch::Tensor own_product(const torch::Tensor& rows, torch::Tensor onto) const;
  virtual torch::Tensor own_input_gradient(const torch::Tensor& grad_rows, torch::Tensor onto) const;

  // A built weight (kBuilt) made some rows at a time, for a frozen expert bank built a few experts
  // at a time (qat/expert_linear.h, BuildBanksInBlocks). False where the layer builds only whole
  // weights.
  virtual bool builds_weight_rows() const { return false; }
  // Rows [begin, end) of matmul_weight(dtype), built alone: the same values. An Error where
  // builds_weight_rows() is false or the rows are not within out_features.
  virtual torch::Tensor matmul_weight_rows(torch::ScalarType dtype, int64_t begin, int64_t end) const;
};

// A setting that holds on this thread while a scope object lives, and what it was after: how a
// decoder layer tells the layers it runs (in its forward, and in its recomputation on autograd's
// thread) what to do with the weights they build. `Tag` makes each setting its own variable.
template <typename Value, typename Tag>
class ThreadScopedSetting {
 public:
  explicit ThreadScopedSetting(Value value) : previous_(current()) { current() = value; }
  ~ThreadScopedSetting() { current() = previous_; }
  ThreadScopedSetting(const ThreadScopedSetting&) = delete;
  ThreadScopedSetting& operator=(const ThreadScopedSetting&) = delete;

 protected:
  static Value& current() {
    thread_local Value value{};
    return value;
  }

 private:
  Value previous_;
};

// While one lives on this thread with bytes > 0, a frozen expert bank that is built again in
// backward (qat/expert_linear.h: not kept) is built at most this many bytes at a time (at least
// one expert), a block of experts at a time, where its base builds rows (builds_weight_rows).
// The decoder layers set it from train.expert_bank_block_mb, in their forward and recomputation.
class BuildBanksInBlocks : public ThreadScopedSetting<int64_t, BuildBanksInBlocks> {
 public:
  using ThreadScopedSetting::ThreadScopedSetting;
  static int64_t bytes() { return current(); }
};

// While one lives on this thread with bytes > 0, a bank built for a product without grad (a
// checkpointed forward) is built whole where the whole bank is at most this many bytes, and in
// BuildBanksInBlocks' blocks where it is more. The backbone sets it to the block limit plus the
// trained weights' gradients plus one recomputed layer's activations: what backward holds beside
// its blocks and the forward does not, so that a whole bank in the forward stays below backward's
// peak (at 128 MB, gpt-oss-20b's 1.06 GB gate_up bank does not fit 0.72 GB; Qwen3-30B-A3B's
// 805 MB one fits 0.96 GB).
class WholeBanksWithoutGrad : public ThreadScopedSetting<int64_t, WholeBanksWithoutGrad> {
 public:
  using ThreadScopedSetting::ThreadScopedSetting;
  static int64_t up_to_bytes() { return current(); }
};

// While one lives on this thread, layers that build their matmul weight (a dequantization) keep
// it for backward instead of building it again there. A checkpointed decoder layer's
// recomputation sets it: its backward follows at once, so the cost is one layer's weights.
class KeepBuiltWeights : public ThreadScopedSetting<bool, KeepBuiltWeights> {
 public:
  using ThreadScopedSetting::ThreadScopedSetting;
  static bool active() { return current(); }
};

struct DenseLinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = false;
  torch::ScalarType dtype = torch::kFloat32;
};

// y = x W^T + b with W [out, in]: torch::nn::Linear's math, registered under the names
// Hugging Face uses (`weight`, `bias`).
class DenseLinear : public LinearLayer {
 public:
  explicit DenseLinear(const DenseLinearOptions& options);
  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return weight_.size(1); }
  int64_t out_features() const override { return weight_.size(0); }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override { return weight_.to(dtype); }
  torch::Tensor bias() const override { return bias_; }
  MatmulWeight matmul_weight_kind() const override { return MatmulWeight::kStored; }
  torch::Tensor matmul_weight(torch::ScalarType dtype) const override { return weight_.to(dtype); }
  const torch::Tensor& weight() const { return weight_; }

 private:
  torch::Tensor weight_;
  torch::Tensor bias_;
};

// A module that keeps its own typed pointer to a linear child (as the Llama attention and MLP
// blocks do, to call `q_proj->forward`) implements this, so that a swap updates the pointer
// together with the registered child. LibTorch's replace_module alone only changes the latter.
class LinearLayerOwner {
 public:
  virtual ~LinearLayerOwner() = default;
  virtual void replace_linear(const std::string& child_name, std::shared_ptr<LinearLayer> layer) = 0;
};

// The device a layer's tensors live on: its first parameter's, else its first buffer's (a
// quantized base may hold only buffers), else the CPU.
torch::Device module_device(const torch::nn::Module& module);

// Replaces the direct child `child_name` of `parent`: through LinearLayerOwner when the parent
// implements it, else with replace_module.
void replace_linear_layer(torch::nn::Module& parent, const std::string& child_name,
                          std::shared_ptr<LinearLayer> layer);

// Replaces the module at the dotted path `name` under `root` (its parent found by the path).
void replace_linear_layer_at(torch::nn::Module& root, const std::string& name, std::shared_ptr<LinearLayer> layer);

struct NamedLinearLayer {
  std::string name;  // dotted module path from the root ("model.layers.0.self_attn.q_proj")
  std::shared_ptr<LinearLayer> layer;
};

// The linear layers under `root` that `select` accepts, in module order. The search does not
// descend into a layer that `opaque` accepts (a wrapper: its base and adapters belong to it).
std::vector<NamedLinearLayer> find_linear_layers(
    const torch::nn::Module& root, const std::function<bool(const std::string&, const LinearLayer&)>& select,
    const std::function<bool(const LinearLayer&)>& opaque);

}  // namespace qtrain::qat
