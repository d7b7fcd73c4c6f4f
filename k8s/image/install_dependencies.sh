#!/bin/sh
# Run as root in the image build (k8s/image/Containerfile): torch, then the project's dependencies and build
# requirements as pyproject.toml lists them, into the image's Python 3.11.
#   $1: pyproject.toml   $2: the staged build inputs (bind-mounted)   $3: the torch index, used when $2 has no wheel
set -eu
pyproject=$1
inputs=$2
torch_index=$3

# Debian's Python refuses a system-wide pip install (PEP 668); in an image that Python is ours alone.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# The Containerfile's cache mount (Ray's image sets HOME to /home/ray, whose cache would land in the layer).
export PIP_CACHE_DIR=/root/.cache/pip
# Behind a TLS-intercepting proxy pip must trust the building machine's CA: for this step only, never in a layer.
if [ -s "$inputs/ca-certificates.crt" ]; then
    export PIP_CERT="$inputs/ca-certificates.crt"
fi

requirements=/tmp/specdec-requirements.txt
python3.11 - "$pyproject" > "$requirements" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
print("\n".join(project["project"]["dependencies"] + project["build-system"]["requires"]))
EOF
torch=$(grep '^torch==' "$requirements") || { echo "install_dependencies.sh: no torch==VERSION in $pyproject" >&2; exit 1; }

# torch first and pinned, as `make setup` does: a wheel staged from the building machine (scripts/image_build.sh
# stages only the pinned version), else the index's build (CPU by default; never PyPI's CUDA download by accident).
wheel=$(find "$inputs/wheels" -maxdepth 1 -name "torch-${torch#torch==}[+-]*.whl" 2>/dev/null | head -n 1)
if [ -n "$wheel" ]; then
    python3.11 -m pip install --quiet "$wheel"
else
    python3.11 -m pip install --quiet "$torch" --index-url "$torch_index"
fi
python3.11 -m pip install --quiet -r "$requirements"
rm -f "$requirements"
python3.11 -c "import torch; print('torch', torch.__version__)"
