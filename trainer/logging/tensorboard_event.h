#pragma once
// TensorBoard's Event records, serialized by protobuf (trainer/logging/tensorboard_event.proto).
// Compiled apart from LibTorch (tensorboard_event_protobuf.cpp): the torch wheel ships older
// protobuf headers of its own, which must not meet Debian's.
#include <cstdint>
#include <string>

namespace qtrain::trainer {

// The first Event of a file: its version, "brain.Event:2".
std::string file_version_event(double wall_time);
// One scalar (Summary.Value.simple_value, a float32).
std::string scalar_event(const std::string& tag, double value, int64_t step, double wall_time);
// One text for TensorBoard's text plugin (a DT_STRING tensor of shape [1]).
std::string text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time);

}  // namespace qtrain::trainer
