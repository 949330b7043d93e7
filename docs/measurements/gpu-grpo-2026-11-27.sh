#!/bin/bash
# Issue #31 on one GPU, in one run: the rollout alone by engine (generate, static cache, static cache + CUDA
# graph) against the bandwidth bound, then one GRPO iteration of ours (static engine, then generate) beside
# TRL's GRPOTrainer (bf16 weights) on the same random 0.5B Llama, prompts, reward and budget
# (benchmarks/gpu_grpo.py; ours with each phase's peak memory), the reference pass alone at 512 and at 32 rows
# per pass, then the profile of a generate rollout. Run from the repo root; OUT gets
# rows.jsonl, one log per verb and profile.txt.
#   GPU: the wheels the image lacks in .whl (transformers 5.23, trl 1.16, datasets, dill, multiprocess,
#        pydantic, hjson, DeepSpeed 0.19.8 built here from its sdist), named in the call's carry
#   CPU rehearsal at toy size:  SMALL=1 OUT=/tmp/grpo_cpu PY=.venv/bin/python bash docs/measurements/gpu-grpo-2026-11-27.sh
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
    tail -1 "$OUT/$name.log" | grep '^{' >> "$OUT/rows.jsonl"
    echo "$name rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
}
rm -rf "$W"
verb workspace 150 workspace "${SIZE[@]}"
# VERBS="ours_static trl": a subset, in that order (a rerun)
for v in ${VERBS:-decode ours_static trl ours_generate score profile}; do
    case $v in
        decode) verb decode 150 decode ;;
        ours_static) verb ours_static 150 ours --engine static ;;
        ours_generate) verb ours_generate 150 ours --engine generate ;;
        trl) verb trl 180 trl ;;
        score) verb score_all 120 score; verb score_micro 120 score --forward-batch 32 ;;
        profile) verb profile 90 profile ;;
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
