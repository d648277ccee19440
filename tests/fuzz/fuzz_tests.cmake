# Included by tests/CMakeLists.txt: builds the fuzz targets (tests/fuzz/CMakeLists.txt, a
# separate clang project) as part of the main build, and runs each briefly as a ctest test
# (its regression inputs, then QTRAIN_FUZZ_SECONDS of fuzzing). tools/fuzz.sh runs them longer.
find_program(QTRAIN_CLANGXX NAMES clang++ clang++-19 clang++-16 clang++-14)
option(QTRAIN_FUZZ "Build the libFuzzer targets with clang and run each briefly as a test" ON)
set(QTRAIN_FUZZ_SECONDS 3 CACHE STRING "seconds of fuzzing per target in ctest")
if(NOT QTRAIN_FUZZ)
  return()
endif()
if(NOT QTRAIN_CLANGXX)
  message(STATUS "qtrain: no clang++, the fuzz targets are not built (tools/setup.sh installs clang)")
  return()
endif()

# clang without its libFuzzer / AddressSanitizer runtimes (the GPU machine's) cannot link them.
foreach(runtime libclang_rt.fuzzer-x86_64.a libclang_rt.asan-x86_64.a)
  execute_process(COMMAND ${QTRAIN_CLANGXX} -print-file-name=${runtime} OUTPUT_VARIABLE runtime_path
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${runtime_path}" OR NOT EXISTS "${runtime_path}")
    message(STATUS "qtrain: ${QTRAIN_CLANGXX} lacks ${runtime}, the fuzz targets are not built "
                   "(tools/setup.sh installs the clang runtime package)")
    return()
  endif()
endforeach()

include(ExternalProject)
find_library(QTRAIN_C10_LIBRARY c10 HINTS ${TORCH_INSTALL_PREFIX}/lib REQUIRED)
set(fuzz_build_dir ${CMAKE_BINARY_DIR}/fuzz)
set(fuzz_cmake_args
  -DCMAKE_CXX_COMPILER=${QTRAIN_CLANGXX}
  -DQTRAIN_SOURCE_DIR=${PROJECT_SOURCE_DIR}
  -DQTRAIN_FIXTURES_DIR=${QTRAIN_FIXTURES_DIR}
  -DQTRAIN_TORCH_INCLUDE_DIR=${TORCH_INSTALL_PREFIX}/include
  -DQTRAIN_C10_LIBRARY=${QTRAIN_C10_LIBRARY})
if(CMAKE_CXX_COMPILER_LAUNCHER)
  list(JOIN CMAKE_CXX_COMPILER_LAUNCHER "$<SEMICOLON>" fuzz_launcher)
  list(APPEND fuzz_cmake_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${fuzz_launcher}")
endif()
ExternalProject_Add(qtrain_fuzz
  SOURCE_DIR ${CMAKE_CURRENT_SOURCE_DIR}/fuzz
  BINARY_DIR ${fuzz_build_dir}
  CMAKE_ARGS ${fuzz_cmake_args}
  BUILD_ALWAYS ON
  INSTALL_COMMAND "")

file(GLOB fuzz_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/*_fuzz.cpp)
foreach(source ${fuzz_sources})
  get_filename_component(name ${source} NAME_WE)
  string(REGEX REPLACE "_fuzz$" "" target ${name})
  add_test(NAME Fuzz.${target}
           COMMAND ${PROJECT_SOURCE_DIR}/tools/fuzz.sh --seconds ${QTRAIN_FUZZ_SECONDS} --build ${fuzz_build_dir}
                   --work ${CMAKE_BINARY_DIR}/fuzz-ctest ${target})
  # The fuzzers read QTRAIN_FIXTURES where it is set, else the directory configured (fuzz_support.h).
  set_tests_properties(Fuzz.${target} PROPERTIES TIMEOUT 120)
endforeach()
