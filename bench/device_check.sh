#!/usr/bin/env bash
# The GPU device check on the lent device machine (docs/benchmarks.md, "GPU device check"):
# install what its image lacks from wheelhouse/ (bench/build_wheelhouse.sh fills it here; the
# device tool carries it over with carry: ["wheelhouse"]: that machine reaches no package index),
# then run bench/device_check.py under a timeout, everything it writes under $OUT:
#   $OUT/device_check.json   every figure        $OUT/device_check.txt  what it printed
#   $OUT/logs/*.log          each run's stderr   $OUT/install.log       pip's output
#   $OUT/nvidia-smi.txt      the GPU as the driver sees it
#
#   bash bench/device_check.sh [device_check.py flags]     # from the repository root or not
#
# Exit status: device_check.py's (0: every check passed; 1: one failed), 124 when the timeout
# (DEVICE_CHECK_TIMEOUT_S, default 480 s) ended it.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/device_check}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
LIMIT_S=${DEVICE_CHECK_TIMEOUT_S:-480}
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# module:distribution, for what the training and export path imports that the image may lack:
# dspy's import-time requirements (not litellm or openai, which it imports only to call an LM),
# onnxslim and pycocotools. dspy itself is installed last, without its dependencies.
NEEDED=(gepa:gepa json_repair:json-repair orjson:orjson pydantic:pydantic jsonschema:jsonschema
        diskcache:diskcache tenacity:tenacity cachetools:cachetools onnxslim:onnxslim
        pycocotools:pycocotools)

missing() {
    local pair
    for pair in "$@"; do
        "$PYTHON" -c "import ${pair%%:*}" 2>/dev/null || echo "${pair#*:}"
    done
}

pip_install() {
    # from the wheelhouse only; as a user install where site-packages is not writable
    "$PYTHON" -m pip install --no-index --find-links "$WHEELHOUSE" "$@" \
        || "$PYTHON" -m pip install --user --no-index --find-links "$WHEELHOUSE" "$@"
}

install_missing() {
    local wanted
    mapfile -t wanted < <(missing "${NEEDED[@]}")
    if ((${#wanted[@]})); then
        echo "installing from $WHEELHOUSE: ${wanted[*]}"
        # with their dependencies from the wheelhouse; should the image's versions not do,
        # every wheel of the wheelhouse as it is
        pip_install "${wanted[@]}" || pip_install --no-deps "$WHEELHOUSE"/*.whl
    fi
    if [[ -n $(missing dspy:dspy) ]]; then
        echo "installing from $WHEELHOUSE: dspy (--no-deps)"
        pip_install --no-deps dspy
    fi
}

unpack_wheelhouse() {
    # the last resort, where pip is missing or cannot write: every wheel unpacked into one
    # folder put first on PYTHONPATH (a wheel is a zip of what site-packages would hold)
    local site=${TMPDIR:-/tmp}/device_check_site wheel
    mkdir -p "$site"
    for wheel in "$WHEELHOUSE"/*.whl; do
        "$PYTHON" -m zipfile -e "$wheel" "$site"
    done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "unpacked $WHEELHOUSE/ into $site, first on PYTHONPATH"
}

mkdir -p "$OUT"
if [[ ! -d $WHEELHOUSE ]]; then
    echo "no $WHEELHOUSE/ here: nothing installed (bash bench/build_wheelhouse.sh makes it)" >&2
else
    install_missing >"$OUT/install.log" 2>&1
    if [[ -n $(missing dspy:dspy onnxslim:onnxslim pycocotools:pycocotools) ]]; then
        unpack_wheelhouse >>"$OUT/install.log" 2>&1  # not in a pipe: it exports PYTHONPATH
    fi
    tail -n 3 "$OUT/install.log"
fi
"$PYTHON" -c 'import dspy, onnxslim, pycocotools, torch, onnxruntime as ort
print(f"python ok: dspy {dspy.__version__}, onnxslim {onnxslim.__version__}, torch "
      f"{torch.__version__}, onnxruntime {ort.__version__}")' \
    || echo "an import failed (see $OUT/install.log): the runs will say what is missing" >&2
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi: not found" >"$OUT/nvidia-smi.txt"

timeout --kill-after=10 "$LIMIT_S" "$PYTHON" bench/device_check.py \
    --json "$OUT/device_check.json" --logs "$OUT/logs" "$@" 2>&1 | tee "$OUT/device_check.txt"
status=${PIPESTATUS[0]}
echo "device_check exit $status; files under $OUT"
exit "$status"
