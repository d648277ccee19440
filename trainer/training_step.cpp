#include "trainer/training_step.h"

#include <algorithm>
#include <cmath>

#include "optim/grad_clip.h"
#include "trainer/model/batch_inputs.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/model/router_loss.h"
#include "trainer/objectives/pair_log_probs.h"
#include "trainer/recipe/recipe_training.h"

namespace qtrain::trainer {

namespace {

// A micro-batch's share of a mixture of experts' load-balancing loss: `weight` · aux. aux stays on
// the device until read, after the backward is queued (reading it at once would hold backward back
// until the forward has drained). Without a router (or none ran): 0.
struct RouterShare {
  double weight = 0;
  torch::Tensor aux;
  double read() const { return aux.defined() ? weight * aux.item<double>() : 0; }
};

// That share for the pass since router_loss->begin(), whose gradient joins backward's at `weight`
// times `gradient_factor` (the factor the micro-batch's loss is multiplied by).
RouterShare router_share(RouterLoss* router_loss, double weight, double gradient_factor) {
  if (router_loss == nullptr) return {};
  router_loss->set_gradient_scale(weight * gradient_factor);
  return {weight, router_loss->aux()};
}

}  // namespace

TrainingStepOptions training_step_options(const Recipe& recipe, int64_t vocab_size, const torch::Device& device) {
  TrainingStepOptions options;
  options.device = device;
  options.loss_chunk_tokens = loss_chunk_tokens(recipe, vocab_size);
  options.fused_loss = recipe.train.fused_loss;
  options.max_grad_norm = recipe.train.max_grad_norm;
  options.optimizer_states_on_host = recipe.train.optimizer_states_on_host;
  options.preference = preference_options(recipe);
  return options;
}

LossOptions TrainingStepOptions::loss_options() const {
  LossOptions options;
  options.chunk_tokens = loss_chunk_tokens;
  options.fused = fused_loss;
  return options;
}

std::optional<PreferenceOptions> preference_options(const Recipe& recipe) {
  const auto& row = find_objective(recipe.train.objective);
  if (!row.pairs) return std::nullopt;
  PreferenceOptions options;
  options.objective = row.objective;
  options.beta = recipe.dpo.beta;
  options.loss_type = recipe.dpo.loss_type;
  options.label_smoothing = recipe.dpo.label_smoothing;
  options.simpo_gamma = recipe.dpo.simpo_gamma;
  options.cpo_alpha = recipe.dpo.cpo_alpha;
  return options;
}

TrainingStep::TrainingStep(LlamaForCausalLMImpl& model, std::vector<torch::Tensor> trainable,
                           optim::Optimizer& optimizer, LossScaler& scaler, TrainingStepOptions options)
    : model_(model),
      trainable_(std::move(trainable)),
      optimizer_(optimizer),
      scaler_(scaler),
      options_(std::move(options)) {
  if (options_.optimizer_states_on_host && !trainable_.empty()) {
    deferred_update_ = std::make_unique<DeferredUpdate>(model_, optimizer_, options_.device);
  }
}

TrainingStep::~TrainingStep() = default;

void TrainingStep::settle_optimizer_state() {
  if (!deferred_update_) return;
  deferred_update_->apply_all();
  deferred_update_->settle();
}

void TrainingStep::set_ranks(ProcessGroup* group, GradientBuckets* buckets) {
  group_ = group;
  buckets_ = buckets;
}

double TrainingStep::accumulate(const std::vector<data::Batch>& micro_batches,
                                const std::function<MicroBatchLoss(const data::Batch&)>& forward) {
  double loss_sum = 0;
  for (size_t index = 0; index < micro_batches.size(); ++index) {
    const bool last = index + 1 == micro_batches.size();
    mark_phase("forward");
    const auto loss = forward(micro_batches[index]);
    // Ranks exchange gradients only in the window's last backward, overlapped with it.
    if (buckets_ && last) buckets_->arm();
    mark_phase("backward");
    loss.backward_from.backward();
    loss_sum += loss.loss_sum();
  }
  if (buckets_) buckets_->finish();
  return loss_sum;
}

TrainingStep::MicroBatchLoss TrainingStep::preference_micro_batch(const data::Batch& cpu_batch, double weight,
                                                                  std::vector<std::pair<std::string, double>>& metric_sums) {
  const auto batch = batch_on_device(cpu_batch, options_.device);
  const auto loss_options = options_.loss_options();
  const auto& preference = *options_.preference;
  PairLogProbs reference;
  if (objective_row(preference.objective).reference) {
    reference = reference_log_probs(model_, batch, loss_options, options_.packed_attention);
  }
  model_.prefetch_lm_head();
  auto* router_loss = model_.router_loss();
  if (router_loss) router_loss->begin();
  const auto hidden = model_.hidden_states(model_inputs(batch, options_.device, options_.packed_attention));
  mark_phase("loss");
  const auto policy = pair_log_probs(model_, hidden, batch, loss_options);
  const auto loss = preference_loss(policy, reference.chosen.defined() ? &reference : nullptr, preference);
  // A mixture of experts' load-balancing loss joins each micro-batch's loss as TRL adds it.
  const auto router = router_share(router_loss, model_.options().experts.router_aux_loss_coef, weight);
  // Read after the backward is queued: the loss and the metrics in two copies from the device.
  PreferenceLoss read_back = loss;
  read_back.loss = loss.loss.detach();
  return {loss.loss * weight, [read_back, router, &metric_sums] {
            read_back.add_metrics_to(metric_sums);
            return read_back.loss.item<double>() + router.read();
          }};
}

StepResult TrainingStep::run(const std::vector<data::Batch>& micro_batches, int64_t step,
                             const AfterBackward& after_backward) {
  StepResult result;
  double predicted_tokens = 0;
  double input_tokens = 0;
  for (const auto& batch : micro_batches) {
    predicted_tokens += static_cast<double>(batch.predicted_tokens);
    input_tokens += static_cast<double>(batch.input_tokens);
  }
  if (group_) {
    const auto totals = group_->sum({predicted_tokens, input_tokens}, "the token count of the step");
    predicted_tokens = totals[0];
    input_tokens = totals[1];
  }
  result.tokens = static_cast<int64_t>(input_tokens);
  if (options_.preference) {
    // Each micro-batch's loss is a mean over its pairs; the step's is the mean over the window's
    // micro-batches on every rank, as TRL (with accelerate) averages them.
    const double window = static_cast<double>(micro_batches.size()) * (group_ ? group_->world_size() : 1);
    const double weight = scaler_.scale() / window;
    double loss_sum = accumulate(micro_batches, [&](const data::Batch& batch) {
      return preference_micro_batch(batch, weight, result.metrics);
    });
    if (buckets_) {
      std::vector<double> sums = {loss_sum};
      for (const auto& metric : result.metrics) sums.push_back(metric.second);
      sums = group_->sum(sums, "the loss of the step");
      loss_sum = sums[0];
      for (size_t index = 0; index < result.metrics.size(); ++index) result.metrics[index].second = sums[index + 1];
    }
    result.loss = loss_sum / window;
    for (auto& metric : result.metrics) metric.second /= window;
    return apply_gradients(result, step, after_backward);
  }
  // The loss is token-weighted over the whole accumulation window (of every rank), as if it
  // were one batch; fp16 scales it so that small gradients survive.
  const double loss_weight = scaler_.scale() / std::max(predicted_tokens, 1.0);
  auto loss_options = options_.loss_options();
  loss_options.gradient = loss_weight;  // the fused loss's gradient, computed in its forward for it
  double loss_sum = accumulate(micro_batches, [&](const data::Batch& batch) -> MicroBatchLoss {
    auto labels = batch.labels.to(options_.device);
    model_.prefetch_lm_head();  // train.lm_head_on_host: it travels while the layers run
    auto* router_loss = model_.router_loss();
    if (router_loss) router_loss->begin();
    auto hidden = model_.hidden_states(model_inputs(batch, options_.device, options_.packed_attention));
    mark_phase("loss");  // the fused loss computes its gradient here, lm_head's visit included
    auto loss = causal_lm_loss(model_, hidden, labels, loss_options, batch.labels);
    // A mixture of experts' load-balancing loss, router_aux_loss_coef · aux per micro-batch as
    // transformers adds it to the mean loss: here weighted by the micro-batch's predicted tokens,
    // as its share of the window's token-weighted loss. Its gradient joins in backward.
    const auto router = router_share(
        router_loss, model_.options().experts.router_aux_loss_coef * static_cast<double>(batch.predicted_tokens),
        loss_weight);
    const auto token_loss_sum = loss.loss_sum.detach();
    return {loss.loss_sum * loss_weight,
            [token_loss_sum, router] { return token_loss_sum.item<double>() + router.read(); }};
  });
  if (buckets_) loss_sum = group_->sum({loss_sum}, "the loss of the step")[0];
  result.loss = loss_sum / std::max(predicted_tokens, 1.0);
  return apply_gradients(result, step, after_backward);
}

StepResult TrainingStep::apply_gradients(StepResult result, int64_t step, const AfterBackward& after_backward) {
  mark_phase("update");  // the caller finishes it
  if (after_backward) after_backward(step, trainable_);

  const bool loss_finite = std::isfinite(result.loss);
  const bool gradients_finite = scaler_.unscale_and_check(trainable_);
  if (!loss_finite || !gradients_finite) {
    optimizer_.zero_grad();
    scaler_.update(/*skipped=*/true);
    result.skipped = true;
    result.skip_reason = !loss_finite ? "the loss is " + std::to_string(result.loss) : "a gradient is inf or NaN";
    return result;
  }
  // The norm is read once the update is queued: the device runs the optimizer meanwhile.
  const auto grad_norm = optim::clip_grad_norm_on_device(trainable_, options_.max_grad_norm);
  if (deferred_update_) {
    deferred_update_->defer();  // each layer's share in the next forward
  } else {
    optimizer_.step();
  }
  optimizer_.zero_grad();
  scaler_.update(/*skipped=*/false);
  result.grad_norm = grad_norm.defined() ? grad_norm.item<double>() : 0.0;
  return result;
}

}  // namespace qtrain::trainer
