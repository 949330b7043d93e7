#!/bin/bash
# Issue #31 on one GPU, in one run, third run (after the compiled decode step and the scoring passes' memory
# change): the rollout alone (static decoder with its CUDA graph, with and without the model's forward compiled)
# against the bandwidth bound; one GRPO iteration of ours with the defaults (static engine, compiled step) beside
# TRL's GRPOTrainer (bf16 weights) on the same random 0.5B Llama, prompts, reward and budget, with each phase's
# peak memory; then ours with bf16 master weights and moments (ZeRO-1), the per-kernel profile of the compiled
# step, ours without the compile, and ours with gradient checkpointing. Run from the repo root; OUT gets
# rows.jsonl, one log per verb, profile.txt and summary.txt. In order of priority: a verb past the call's limit
# loses only what follows it.
#   GPU: the wheels the image lacks in .whl (transformers 5.23.0, trl 1.16.0, datasets 5.2.0, dill, multiprocess,
#        pydantic + pydantic_core + annotated_types + typing_inspection, hjson, DeepSpeed 0.19.8 built here from
#        its sdist with `pip wheel --no-deps`), named in the call's carry
#   CPU rehearsal at toy size:  SMALL=1 OUT=/tmp/grpo_cpu PY=.venv/bin/python bash docs/measurements/gpu-grpo-2026-11-27b.sh
set -u
export RLHF_TRACKING=off PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_grpo_out}; mkdir -p "$OUT"
PY=${PY:-python3}
W=${W:-/tmp/gpu_grpo_ws}
if [ -d .whl ] && [ "${SMALL:-0}" = 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -2
    export PYTHONPATH=/tmp/site:$PWD
fi
"$PY" -c "import torch, transformers, trl, deepspeed; print('torch', torch.__version__, torch.cuda.get_device_name()
    if torch.cuda.is_available() else 'cpu', 'transformers', transformers.__version__, 'trl', trl.__version__,
    'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee "$OUT/summary.txt"
SIZE=()
if [ "${SMALL:-0}" = 1 ]; then
    SIZE=(--shape '{"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}'
          --workload '{"prompts": 4, "group": 4, "prompt_len": 16, "new_tokens": 8, "micro_batch": 4}' --rows 60)
fi
verb() {  # verb NAME TIMEOUT_S ARGS...: one process, its log, its JSON row and its time
    local name=$1 limit=$2; shift 2
    local t0; t0=$(date +%s)
    timeout "$limit" "$PY" -m benchmarks.gpu_grpo "$@" --root "$W" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -1 "$OUT/$name.log" | grep '^{' | sed "s/^{/{\"name\": \"$name\", /" >> "$OUT/rows.jsonl"
    echo "$name rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
}
rm -rf "$W"
verb workspace 150 workspace "${SIZE[@]}"
BF16=(--set compute.zero_stage=1 --set compute.bf16_master=true)
for v in ${VERBS:-decode ours trl ours_bf16 profile ours_nocompile ours_ckpt}; do
    case $v in
        decode) verb decode 150 decode --engines static,static_compiled ;;
        ours) verb ours 150 ours --engine static ;;
        trl) verb trl 180 trl ;;
        ours_bf16) verb ours_bf16 150 ours --engine static "${BF16[@]}" ;;
        profile) verb profile 90 profile --engines static_compiled ;;
        ours_nocompile) verb ours_nocompile 120 ours --engine static --set rlhf.rollout_compile=false ;;
        ours_ckpt) verb ours_ckpt 150 ours --engine static --set compute.gradient_checkpointing=true ;;
    esac
done
"$PY" -c "
import json, sys
for line in open('$OUT/rows.jsonl'):
    r = json.loads(line)
    if r['verb'] == 'profile':
        open('$OUT/profile.txt', 'w').write(r['by_device'] + '\n' + r['by_host'])
        continue
    print(json.dumps({k: v for k, v in r.items() if k not in ('by_device', 'by_host')})[:900])
" | tee -a "$OUT/summary.txt"
