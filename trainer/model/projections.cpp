#include "trainer/model/projections.h"

#include "kernels/error.h"

namespace qtrain::trainer {

LinearFactory dense_linear_factory() {
  return [](const std::string&, const qat::DenseLinearOptions& options) -> std::shared_ptr<qat::LinearLayer> {
    return std::make_shared<qat::DenseLinear>(options);
  };
}

qat::DenseLinearOptions projection_options(const ProjectionShape& shape, torch::ScalarType dtype) {
  qat::DenseLinearOptions options;
  options.in_features = shape.in;
  options.out_features = shape.out;
  options.bias = shape.bias;
  options.dtype = dtype;
  return options;
}

void register_projections(torch::nn::Module& owner, const std::vector<ProjectionShape>& shapes,
                          const std::string& prefix, const LinearFactory& make_linear, torch::ScalarType dtype,
                          const ProjectionSlot& slot) {
  for (const auto& shape : shapes) {
    auto* member = slot(shape.name);
    if (member == nullptr) throw Error(ErrorCode::kInternal, owner.name() + " has no member for its projection '" + shape.name + "'");
    *member = owner.register_module(shape.name, make_linear(prefix + "." + shape.name, projection_options(shape, dtype)));
  }
}

void replace_projection(torch::nn::Module& owner, const ProjectionSlot& slot, const std::string& child_name,
                        std::shared_ptr<qat::LinearLayer> layer) {
  auto* member = slot(child_name);
  if (member == nullptr || !*member) {
    throw Error(ErrorCode::kInternal, owner.name() + " has no linear layer '" + child_name + "' to replace");
  }
  *member = owner.replace_module(child_name, std::move(layer));
}

}  // namespace qtrain::trainer
