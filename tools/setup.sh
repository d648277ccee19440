#!/usr/bin/env bash
# Installs what is missing and builds qtrain into build/.
#
#   tools/setup.sh            Debian packages, the pinned Python environment, Release build
#   QTRAIN_OFFLINE=1 ...      install nothing; use the torch that `python3` imports (GPU machine)
#   QTRAIN_TORCHAO=0 ...      skip torchao (installed by default: the tests that compare our QAT
#                             fake quantizers with torchao's run it)
#   QTRAIN_LLAMA_CPP=1 ...    also llama-cpp-python (builds llama.cpp from source, CPU only, a few
#                             minutes once per Python environment) for the tests that run our GGUF
#                             export in llama.cpp; tools/run-tests.sh sets it unless it is 0
#
# Idempotent: every step checks first and skips what is already there. The Python environment
# (torch wheel ~4.7 GB with its CUDA libraries) lives outside the clone, keyed by the pinned
# versions, so fresh clones and CI reuse it. uv (from PyPI, pinned) installs into it: it fetches
# and unpacks the wheels in parallel (the pins in 34 s on 2 cores, where pip took 124 s).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

TORCH_VERSION=2.11.0
PYTHON_PINS=(
  "torch==${TORCH_VERSION}"
  "transformers==5.17.0"
  "peft==0.21.0"
  "tokenizers==0.23.2"
  "safetensors==0.8.0"
  "gguf==0.19.0"
)
DEBIAN_PACKAGES=(
  build-essential cmake ninja-build ccache git python3 python3-venv python3-pip
  libboost-program-options-dev libyaml-cpp-dev nlohmann-json3-dev libpcre2-dev libgtest-dev libgloo-dev
  clang libprotobuf-dev protobuf-compiler
)

log() { printf '[setup %d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

pin_key() { printf '%s\n' "${PYTHON_PINS[@]}" | sha256sum | cut -c1-12; }
VENV_DIR=${QTRAIN_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/qtrain/venv-torch${TORCH_VERSION}-$(pin_key)}
UV_PIN="uv==0.13.9"

# uv's `pip install` into the environment (uv itself arrives with the environment's pip).
pip_install() {
  [ -x "$VENV_DIR/bin/uv" ] || "$VENV_DIR/bin/pip" install -q "$UV_PIN"
  # Compiled to bytecode as pip does (where PYTHONDONTWRITEBYTECODE is set, as on CI machines, every
  # interpreter would otherwise compile transformers again: the MoE interop tests ran 2x slower).
  "$VENV_DIR/bin/uv" pip install -q --compile-bytecode --python "$VENV_DIR/bin/python" "$@"
}

install_debian_packages() {
  local missing=()
  for package in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && { log "Debian packages: all present"; return; }
  log "Debian packages: installing ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# libFuzzer comes with clang's runtime package, which Debian names by version
# (libclang-rt-14-dev on bookworm) and clang only recommends.
install_libfuzzer() {
  command -v clang++ >/dev/null || return 0
  [ -f "$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ] && { log "libFuzzer: present"; return; }
  local package="libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev"
  log "libFuzzer: installing $package"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$package"
}

install_python_environment() {
  if [ -f "$VENV_DIR/.complete" ]; then
    log "Python environment: $VENV_DIR (present)"
    return
  fi
  log "Python environment: creating $VENV_DIR (torch wheel is large; this happens once)"
  rm -rf "$VENV_DIR"
  python3 -m venv "$VENV_DIR"
  "$VENV_DIR/bin/pip" install -q --upgrade pip
  # llama.cpp compiles while torch downloads.
  [ "${QTRAIN_LLAMA_CPP:-0}" = 1 ] && start_llama_cpp_wheel
  pip_install "${PYTHON_PINS[@]}"
  touch "$VENV_DIR/.complete"
}

# Packages installed into the environment beside PYTHON_PINS, whose hash names it (adding one
# there would rebuild the whole ~4.7 GB environment): `pin` unless `module` imports, with pip's
# extra arguments.
install_unless_importable() {
  local module=$1 pin=$2
  shift 2
  if "$VENV_DIR/bin/python" -c "import $module" 2>/dev/null; then
    log "$pin: present"
    return
  fi
  log "$pin: installing"
  pip_install "$@" "$pin"
}

# torchao, whose fake quantizers tests/trainer/torchao_reference_test.cpp compares with ours. Its
# wheel needs nothing beyond torch (its requirements are dev extras); --no-deps keeps pip from
# touching the pinned torch.
install_torchao() { install_unless_importable torchao "torchao==0.18.0" --no-deps; }

# compressed-tensors (llm-compressor's format), whose own compressors and transformers' loader
# tests/trainer/compressed_tensors_test.cpp compares our exports and imports with. --no-deps keeps
# pip from touching torch / transformers; loguru is its one requirement they lack.
install_compressed_tensors() {
  install_unless_importable loguru "loguru==0.7.3"
  install_unless_importable compressed_tensors "compressed-tensors==0.20.0" --no-deps
}

# tensorboard, whose EventAccumulator tests/e2e/run_outputs_test.cpp reads our event files with
# (it brings its protobuf, grpcio, markdown and werkzeug; nothing pinned above changes).
install_tensorboard() { install_unless_importable tensorboard "tensorboard==2.21.0"; }

# TRL, whose own DPOTrainer, ORPOTrainer and CPOTrainer tests/trainer/preference_test.cpp compares our
# preference objectives with (it brings datasets and its pyarrow / pandas; torch, transformers,
# peft and accelerate are already pinned above and stay).
install_trl() {
  install_unless_importable datasets "datasets==5.2.0"
  install_unless_importable trl "trl==1.16.0"
}

# llama-cpp-python builds llama.cpp from source (CPU only; minutes of every core): libllama and
# libggml alone (no common library, tools/llama_cpp_library_only.cmake; no multimodal mtmd library,
# which llama_cpp imports only on use), at -O1: the tests run tiny models, and -O3 costs a third more
# compile time for speed they do not need; and eight sources to a translation unit (CMake's unity
# build: 158 -> 65 s for libllama and libggml on 2 cores; the GGUF tests pass with it). Its wheel
# builds in the background from the moment the environment has pip, beside the torch download and
# qtrain's own build, and is installed at the end.
LLAMA_CPP_PIN="llama-cpp-python==0.3.36"
start_llama_cpp_wheel() {
  if "$VENV_DIR/bin/python" -c "import llama_cpp" 2>/dev/null; then
    log "$LLAMA_CPP_PIN: present"
    return
  fi
  llama_cpp_wheels=$(mktemp -d)
  log "$LLAMA_CPP_PIN: building its wheel in the background (log: $llama_cpp_wheels/build.log)"
  # ggml-cpu's AMX kernels, built where -march=native has AMX, do not compile in a unity build (its
  # block structs are declared for C and C++ in one unit): build them unit by unit there.
  local unity=ON
  grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && unity=OFF
  CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF \
-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
-DCMAKE_UNITY_BUILD=$unity -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
'-DCMAKE_PROJECT_llama.cpp_INCLUDE=$ROOT/tools/llama_cpp_library_only.cmake' \
-DCMAKE_C_FLAGS_RELEASE='-O1 -DNDEBUG' -DCMAKE_CXX_FLAGS_RELEASE='-O1 -DNDEBUG'" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$VENV_DIR/bin/pip" wheel --no-deps --no-cache-dir -w "$llama_cpp_wheels" "$LLAMA_CPP_PIN" \
    >"$llama_cpp_wheels/build.log" 2>&1 &
  llama_cpp_build=$!
}

finish_llama_cpp() {
  [ -n "${llama_cpp_build:-}" ] || return 0
  log "$LLAMA_CPP_PIN: waiting for its wheel"
  if ! wait "$llama_cpp_build"; then
    tail -40 "$llama_cpp_wheels/build.log" >&2
    log "$LLAMA_CPP_PIN: building the wheel failed (above; QTRAIN_LLAMA_CPP=0 skips llama.cpp and its tests)"
    exit 1
  fi
  pip_install "$llama_cpp_wheels"/llama_cpp_python-*.whl
  rm -rf "$llama_cpp_wheels"
  log "$LLAMA_CPP_PIN: installed"
}

if [ "${QTRAIN_OFFLINE:-0}" = 1 ]; then
  log "QTRAIN_OFFLINE=1: installing nothing, using $(command -v python3)"
  PYTHON=python3
else
  install_debian_packages
  install_libfuzzer
  install_python_environment
  # What only the tests run (the demo needs none of it): tools/run-tests.sh sets QTRAIN_TEST_PACKAGES=1.
  if [ "${QTRAIN_TEST_PACKAGES:-0}" = 1 ]; then
    [ "${QTRAIN_TORCHAO:-1}" = 1 ] && install_torchao
    install_compressed_tensors
    install_tensorboard
    install_trl
  fi
  [ "${QTRAIN_LLAMA_CPP:-0}" = 1 ] && [ -z "${llama_cpp_build:-}" ] && start_llama_cpp_wheel
  PYTHON="$VENV_DIR/bin/python"
fi

TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
# LibTorch's CMake ignores CMAKE_CUDA_ARCHITECTURES and otherwise builds for 11 architectures.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}

cmake_args=(
  -S "$ROOT" -B "$ROOT/build" -G Ninja
  -DCMAKE_BUILD_TYPE=Release
  "-DCMAKE_PREFIX_PATH=${TORCH_PREFIX}${CMAKE_PREFIX_PATH:+;${CMAKE_PREFIX_PATH//:/;}}"
  "-DQTRAIN_PYTHON=$PYTHON"
)
[ -n "${CMAKE_CUDA_ARCHITECTURES:-}" ] && cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=$CMAKE_CUDA_ARCHITECTURES")

log "configuring build/"
cmake "${cmake_args[@]}" >"$ROOT/build-configure.log" 2>&1 \
  || { cat "$ROOT/build-configure.log" >&2; exit 1; }
log "building (Release, $(nproc) jobs)"
# QTRAIN_BUILD_TARGET=qtrain builds the binary alone (quick runs on the GPU machine).
cmake --build "$ROOT/build" -j "$(nproc)" ${QTRAIN_BUILD_TARGET:+--target "$QTRAIN_BUILD_TARGET"}
finish_llama_cpp
log "done: $ROOT/build/qtrain"
