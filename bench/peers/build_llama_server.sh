#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the source vendored in the PyPI sdist of
# llama-cpp-python (PyPI is reachable here; GitHub is not), once, into a cache.
# AMX is disabled: AMX tile code in this build dies with SIGILL on these hosts.
# Then converts Tandem's SmolLM2 safetensors to a bfloat16 and a Q8_0 GGUF with the
# sdist's own convert_hf_to_gguf.py: llama.cpp on the very weights Tandem serves, beside
# the Q4_1 GGUF the model ships as (Q8_0: the integer modes' peer).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp-$VERSION"
BIN="$CACHE/bin/llama-server"
PIP="${PIP:-.venv/bin/pip}"
PY="${PY:-.venv/bin/python}"
SRC="$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
GGUF_BF16="$CACHE/smollm2-135m-instruct-bf16.gguf"
GGUF_Q8_0="$CACHE/smollm2-135m-instruct-q8_0.gguf"
if [ ! -d "$SRC" ]; then
    mkdir -p "$CACHE/src"
    "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/src"
    tar xzf "$CACHE/src/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src"
fi
if [ -x "$BIN" ]; then
    echo "llama-server already built: $BIN"
else
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
    cmake --build "$CACHE/build" --target llama-server -j "$(nproc)"
    mkdir -p "$CACHE/bin"
    cp "$CACHE/build/bin/llama-server" "$BIN"
    echo "built $BIN"
fi
# The converter imports sentencepiece before it looks for a tokenizer.model
# (SmolLM2 has none: it goes on to tokenizer.json); a tool of the benchmark only.
MODEL_DIR=$("$PY" -c "from common.model_files import resolve_model_dir as r; print(r('smollm2-135m-instruct'))")
for pair in "bf16:$GGUF_BF16" "q8_0:$GGUF_Q8_0"; do
    outtype="${pair%%:*}" out="${pair#*:}"
    if [ ! -f "$out" ]; then
        "$PIP" install -q sentencepiece
        PYTHONPATH="$SRC/gguf-py" "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
            --outtype "$outtype" --outfile "$out.part"
        mv "$out.part" "$out"
    fi
    echo "$outtype GGUF: $out"
done
