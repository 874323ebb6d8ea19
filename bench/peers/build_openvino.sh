#!/usr/bin/env bash
# OpenVINO GenAI as an engine-level peer (bench/offline.py), in a venv of its own under
# the cache: its packages are pinned to one release, and optimum/optimum-intel go in with
# --no-deps because their unpinned torchvision would pull a CUDA torch. torch is our
# pinned CPU build, installed first. Then exports Tandem's SmolLM2 safetensors to an
# OpenVINO IR in float32 (the plugin computes in bf16 on AVX512-BF16/AMX CPUs unless told
# otherwise; bench/peers/openvino_runner.py chooses the precision at load time).
set -euo pipefail
OV_VERSION="${OPENVINO_VERSION:-2026.4.1}"
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}/openvino-$OV_VERSION"
VENV="$CACHE/venv"
IR="$CACHE/smollm2-135m-instruct-fp32"
PY="${PY:-.venv/bin/python}"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q "openvino==$OV_VERSION" "openvino-genai==$OV_VERSION.0" \
        "openvino-tokenizers==$OV_VERSION.0" "transformers<5.6" "huggingface-hub<1.22" \
        "requests>=2.33,<3" nncf onnx
    "$VENV/bin/pip" install -q --no-deps optimum==2.3.0 optimum-intel==2.2.0
    touch "$VENV/.complete"
fi
if [ ! -f "$IR/openvino_model.xml" ]; then
    MODEL_DIR=$("$PY" -c "from common.model_files import resolve_model_dir as r; print(r('smollm2-135m-instruct'))")
    rm -rf "$IR.part"
    "$VENV/bin/optimum-cli" export openvino --model "$MODEL_DIR" \
        --task text-generation-with-past --weight-format fp32 "$IR.part"
    mv "$IR.part" "$IR"
fi
echo "OpenVINO GenAI venv: $VENV"
echo "OpenVINO IR: $IR"
