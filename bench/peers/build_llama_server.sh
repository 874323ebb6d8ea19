#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the source vendored in the PyPI sdist of
# llama-cpp-python (PyPI is reachable here; GitHub is not), once, into a cache.
# AMX is disabled: AMX tile code in this build dies with SIGILL on these hosts.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp-$VERSION"
BIN="$CACHE/bin/llama-server"
PIP="${PIP:-.venv/bin/pip}"
if [ -x "$BIN" ]; then
    echo "llama-server already built: $BIN"
    exit 0
fi
mkdir -p "$CACHE/src"
"$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/src"
tar xzf "$CACHE/src/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src"
SRC="$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)"
mkdir -p "$CACHE/bin"
cp "$CACHE/build/bin/llama-server" "$BIN"
echo "built $BIN"
