#!/bin/bash
# Packed groups against the shared prompt cache and the plain forward on a GPU, bf16, a random 1.1B-parameter
# Llama shape (2048 wide, 16 layers, 32k vocabulary): python -m benchmarks.shared_prefix at four
# prompt / response / group shapes, the packing bound lifted so that every shape is packed. Run from the repo
# root; OUT gets the JSON rows. GPU (2026-11-26, H200): the wheels the image lacks in .gpuwheels.
set -u
OUT=${OUT:-/tmp/packing_out}; mkdir -p "$OUT"
PY=${PY:-python3}
if [ -d .gpuwheels ]; then "$PY" -m pip install -q --no-deps .gpuwheels/*.whl 2>&1 | tail -1; fi
B=("$PY" -m benchmarks.shared_prefix --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" --hidden 2048
   --intermediate 5632 --layers 16 --heads 16 --vocab 32000 --rows 64 --repeats 5 --pack-max-width 65536)
for shape in "64 32 8" "128 128 4" "128 256 8" "256 512 8"; do
    read -r p r g <<< "$shape"
    timeout "${TIMEOUT:-240}" "${B[@]}" --prompt-len "$p" --response-len "$r" --group "$g" | tee -a "$OUT/rows.jsonl"
done
