#!/usr/bin/env bash
# Fill .wheels/ (repo root, git-ignored) with the small binary wheels the default job imports
# that a GPU image with its own torch may lack, for bench/gpu_check.sh to install offline
# (pip install --no-index --no-deps --find-links .wheels ...).
#
#   bash bench/gpu_wheels.sh [PYTHON_VERSION ...]     default: 3.11 3.12 3.13
#
# Why several Python versions: the device's interpreter is not known here (the H200 image seen so
# far has Python 3.12); pip picks the one wheel that matches at install time.
# Why these packages: torch, numpy, safetensors, tokenizers, jinja2 and rich come with such images;
# msgspec (every message), pyzmq (every socket) and crc32c (segment-log checksums) do not.
# Versions are this venv's, so the device runs what the test suite ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSIONS=("$@")
[[ ${#VERSIONS[@]} -gt 0 ]] || VERSIONS=(3.11 3.12 3.13)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux_2_5_x86_64 manylinux1_x86_64)

pins=()
for name in msgspec pyzmq crc32c; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [[ -n "$version" ]] || { echo "gpu_wheels: $name is not installed in $PY; cannot pin it" >&2; exit 1; }
    pins+=("$name==$version")
done

mkdir -p .wheels
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
for v in "${VERSIONS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
        "${platform_args[@]}" -d .wheels "${pins[@]}"
done
printf '%s\n' "${pins[@]}" > .wheels/requirements.txt
echo "gpu_wheels: $(ls .wheels/*.whl | wc -l) wheels for Python ${VERSIONS[*]} in .wheels/ ($(du -sh .wheels | cut -f1)):"
ls .wheels
