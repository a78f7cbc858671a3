#!/usr/bin/env bash
# FlashInfer as a peer of bench_decode.py on a GPU machine with no network.
#
#   benchmarks/flashinfer_offline.sh pack            # here, with network: writes $ARCHIVE
#   source benchmarks/flashinfer_offline.sh unpack   # there: extracts it, sets PYTHONPATH
#
# `pack` installs the pinned FlashInfer wheel and the one dependency the GPU image lacks
# (apache-tvm-ffi; the rest, torch, numpy, ninja, requests, ..., are on the image) for
# CPython 3.12 on x86-64 into a folder, and compresses it: 65 MB of wheels, 19 MB as tar.xz, which
# fits the device tool's 64 MiB carry where the wheels do not. FlashInfer compiles its MLA kernels
# (fa3 on Hopper) with the machine's nvcc at the first plan, once per machine.

FLASHINFER_VERSION=0.7.2.post1
TVM_FFI_VERSION=0.1.15.post2
ARCHIVE=${ARCHIVE:-.whl/flashinfer_site_cp312.tar.xz}
SITE=${SITE:-/tmp/flashinfer_site}

case "${1:-}" in
pack)
    set -euo pipefail  # run, not sourced
    work=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d "$work/wheels" "flashinfer-python==$FLASHINFER_VERSION" \
        "apache-tvm-ffi==$TVM_FFI_VERSION"
    python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --target "$work/site" "$work"/wheels/*.whl
    mkdir -p "$(dirname "$ARCHIVE")"
    tar -C "$work/site" -cJf "$ARCHIVE" .
    rm -rf "$work"
    ls -l "$ARCHIVE"
    ;;
unpack)
    if [ ! -d "$SITE/flashinfer" ]; then
        mkdir -p "$SITE" && tar -C "$SITE" -xJf "$ARCHIVE" || return 1
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    # Keep FlashInfer's JIT builds beside the site so that later calls on this machine reuse them.
    export FLASHINFER_WORKSPACE_BASE="$SITE"
    ;;
*)
    echo "usage: $0 pack | source $0 unpack" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
