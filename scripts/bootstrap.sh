#!/usr/bin/env bash
# One-shot set-up for a fresh machine: system packages for FUSE, then a local virtual
# environment with kvfs and its dev tools. Safe to run again; it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

need_apt=()
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need_apt+=(libfuse3-dev pkg-config)
command -v rsync >/dev/null 2>&1 || need_apt+=(rsync)
# (tests run a store with its clock off: tests/test_archive_background.py)
command -v faketime >/dev/null 2>&1 || need_apt+=(faketime)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "bootstrap: installing system packages: ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
EXTRAS=${EXTRAS:-dev,engines}
case ",$EXTRAS," in
    *,engines,*)
        # Pin the CPU build first: an unpinned torch would pull several GB of CUDA wheels.
        # A wheel on this machine's find-links (a CPU build where one is provided) first;
        # else PyTorch's CPU index (PyPI's torch 2.13.0 for Linux is the CUDA build).
        echo "bootstrap: installing torch==2.13.0 (CPU) into $VENV"
        if ! "$VENV/bin/python" -c "import torch" 2>/dev/null \
            && ! "$VENV/bin/python" -m pip install -q --no-deps --no-index "torch==2.13.0" >/dev/null 2>&1; then
            "$VENV/bin/python" -m pip install -q --no-deps "torch==2.13.0" \
                --index-url https://download.pytorch.org/whl/cpu
        fi
        "$VENV/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | { grep -vE '^(WARNING: Location|DEPRECATION)' || true; } ;;
esac
echo "bootstrap: installing kvfs[$EXTRAS] into $VENV"
"$VENV/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[$EXTRAS]" 2>&1 | { grep -vE '^(WARNING: Location|DEPRECATION)' || true; }
"$VENV/bin/python" -c "import kvfs, pyfuse3, trio, blake3" 
touch "$VENV/.bootstrapped"
