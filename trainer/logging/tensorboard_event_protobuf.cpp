#include "trainer/logging/tensorboard_event.h"

#include "tensorboard_event.pb.h"

namespace qtrain::trainer {

namespace {

constexpr int kStringDtype = 7;  // TensorFlow's DT_STRING

tensorboard::Event event_at(int64_t step, double wall_time) {
  tensorboard::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  return event;
}

}  // namespace

std::string file_version_event(double wall_time) {
  tensorboard::Event event;
  event.set_wall_time(wall_time);
  event.set_file_version("brain.Event:2");
  return event.SerializeAsString();
}

std::string scalar_event(const std::string& tag, double value, int64_t step, double wall_time) {
  auto event = event_at(step, wall_time);
  auto* entry = event.mutable_summary()->add_value();
  entry->set_tag(tag);
  entry->set_simple_value(static_cast<float>(value));
  return event.SerializeAsString();
}

std::string text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  auto event = event_at(step, wall_time);
  auto* entry = event.mutable_summary()->add_value();
  entry->set_tag(tag);
  entry->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  auto* tensor = entry->mutable_tensor();
  tensor->set_dtype(kStringDtype);
  tensor->mutable_tensor_shape()->add_dim()->set_size(1);
  tensor->add_string_val(text);
  return event.SerializeAsString();
}

}  // namespace qtrain::trainer
