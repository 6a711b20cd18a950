#!/usr/bin/env bash
# Build llama.cpp's own C++ server (`llama-server`), the llama.cpp peer users run, for `kvlab bench compare`.
#
# Why this source: the llama.cpp that the llama-cpp-python 0.3.36 sdist vendors is the one the optional
# llama-cpp-python extra uses, so both llama.cpp peers run the same code. Why these flags: on a Xeon with AMX
# a native build dies in ggml's AMX code, so the build targets AVX2 (+FMA/F16C) explicitly and leaves
# AVX-512 and AMX off on every machine; one binary, the same instruction set everywhere. No curl: nothing
# is downloaded by the server.
#
# Usage: scripts/build_llama_server.sh [DIR]     (default /work/peers; heavy, about 5-10 minutes on 2 cores)
#   flock /tmp/kvlab-heavy.lock scripts/build_llama_server.sh
# Prints the binary's path; `kvlab bench compare --peers kvlab,llama-server` finds it through
# KVLAB_LLAMA_SERVER or DIR/llama-server.
set -euo pipefail
DIR="${1:-/work/peers}"
mkdir -p "$DIR"
cd "$DIR"
SRC="llama_cpp_python-0.3.36"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    pip download --quiet --no-binary :all: --no-deps 'llama-cpp-python==0.3.36' -d .
    tar xzf "$SRC.tar.gz"
fi
cmake -S "$SRC/vendor/llama.cpp" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > cmake.log
cmake --build build --target llama-server llama-bench -j "$(nproc)" > build.log
cp build/bin/llama-server build/bin/llama-bench .
./llama-server --version 2>&1 | head -2 >&2
echo "$DIR/llama-server"
