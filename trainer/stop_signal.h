#pragma once
// SIGTERM and SIGINT as requests to stop cleanly: the training loop finishes its step, saves a
// checkpoint and returns. A second SIGINT (an impatient Ctrl-C) exits at once, status 130,
// without touching the checkpoints already on disk (a checkpoint being written is left as a
// staging directory that the next run removes).
namespace qtrain::trainer {

void install_stop_signal_handlers();
bool stop_requested();

}  // namespace qtrain::trainer
