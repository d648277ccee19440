# tools/setup.sh builds llama-cpp-python's wheel with this file as CMAKE_PROJECT_llama.cpp_INCLUDE,
# which CMake includes right after llama.cpp's project() call. llama-cpp-python forces
# LLAMA_BUILD_COMMON on in the cache, but its Python binding loads only libllama and libggml: a
# normal variable shadows the cache entry in llama.cpp's directory scope, leaving out the common
# library (chat parsers, argument parsing) and its HTTP client, about 400 s of a 2-core machine.
set(LLAMA_BUILD_COMMON OFF)
