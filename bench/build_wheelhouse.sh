#!/usr/bin/env bash
# Fill wheelhouse/ (git-ignored) with the wheels the GPU device machine lacks for training and
# export, for its Python: CPython 3.12, manylinux x86_64. That machine reaches no package index;
# bench/device_check.sh installs from this folder, which the device tool carries over
# (carry: ["wheelhouse"], with the work tree: 64 MiB in all).
#
#   bash bench/build_wheelhouse.sh            # run on a machine that reaches PyPI
#
# What goes in: dspy without its dependencies, then dspy's other requirements, onnxslim and
# pycocotools with theirs. Left out on purpose:
# - litellm (a 42 MB wheel, and 17 MB more of botocore behind it) and openai: dspy imports them
#   lazily, only when an LM is called (pipeline.py's --teacher_lm), never on the training and
#   export path; bench/device_check.sh installs dspy with --no-deps for that reason;
# - torch-pruning (--prune), ray (--engine ray), fastapi/uvicorn (serve.py): not on the path;
# - every package the GPU image already has (IMAGE_HAS below, deleted after the download).
# The versions are the ones this repository's tests run with (.venv), so that the GPU machine
# runs the same code.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
PYTHON=${PYTHON:-python3}
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux_2_28_x86_64)
DSPY=dspy==3.4.1
# dspy 3.4.1's requirements but litellm and openai (see above), pinned as tested
DSPY_DEPS=(gepa==0.1.4 pydantic==2.14.4 jsonschema==4.26.0 orjson==3.13.0 json-repair==0.64.6
           diskcache==5.6.3 tenacity==9.2.1 cachetools==8.0.3 anyio cloudpickle regex requests
           pyyaml tqdm)
EXPORT=(onnxslim==0.1.98 pycocotools==2.0.11)
# On the GPU image (Python 3.12.3, torch 2.11, torchvision 0.26) already, with what torch,
# transformers, onnx and requests bring. typing-extensions is kept all the same (48 KB):
# pydantic 2.14 needs >= 4.16, which the image may predate.
IMAGE_HAS=(numpy pandas pillow tqdm onnx onnxruntime onnxscript safetensors transformers
           tokenizers huggingface_hub hf_xet matplotlib scikit_learn scipy pyyaml regex requests
           urllib3 idna certifi charset_normalizer anyio sniffio cloudpickle httpx httpcore h11
           jinja2 markupsafe rich pyarrow psutil prometheus_client attrs packaging filelock
           fsspec tiktoken protobuf sympy mpmath networkx ml_dtypes torch torchvision)

normalise() { tr 'A-Z.-' 'a-z__' <<<"$1"; }

rm -rf "$WHEELHOUSE"
mkdir -p "$WHEELHOUSE"
"$PYTHON" -m pip download "${TARGET[@]}" --no-deps -d "$WHEELHOUSE" "$DSPY"
"$PYTHON" -m pip download "${TARGET[@]}" -d "$WHEELHOUSE" "${DSPY_DEPS[@]}" "${EXPORT[@]}"

for wheel in "$WHEELHOUSE"/*.whl; do
    name=$(normalise "$(basename "$wheel" | cut -d- -f1)")
    for have in "${IMAGE_HAS[@]}"; do
        if [[ $name == "$(normalise "$have")" ]]; then
            rm -f "$wheel"
            echo "left out (the image has it): $(basename "$wheel")"
        fi
    done
done

echo
echo "wheelhouse: $(ls "$WHEELHOUSE" | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
ls -1 "$WHEELHOUSE"
