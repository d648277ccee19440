#include "trainer/stop_signal.h"

#include <unistd.h>

#include <atomic>
#include <csignal>

namespace qtrain::trainer {

namespace {

std::atomic<int> requests{0};

extern "C" void on_stop_signal(int signal_number) {
  const int previous = requests.fetch_add(1);
  if (previous > 0 && signal_number == SIGINT) _exit(130);
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

bool stop_requested() { return requests.load() > 0; }

}  // namespace qtrain::trainer
