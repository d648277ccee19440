#include "qat/adapter_switch.h"

namespace qtrain::qat {

namespace {
thread_local bool enabled = true;
}  // namespace

bool adapters_enabled() { return enabled; }

AdaptersOff::AdaptersOff() : previous_(enabled) { enabled = false; }

AdaptersOff::~AdaptersOff() { enabled = previous_; }

}  // namespace qtrain::qat
