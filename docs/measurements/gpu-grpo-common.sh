# The shared part of docs/measurements/gpu-grpo-*.sh, sourced from the repo root: the environment, the wheels
# the GPU image lacks (.whl, when present and not SMALL=1), the versions, the toy size for a CPU rehearsal
# (SMALL=1), `verb NAME TIMEOUT_S ARGS...` (one `python -m benchmarks.gpu_grpo` process: its log, its JSON row
# tagged with NAME in OUT/rows.jsonl, its exit code and time in OUT/summary.txt), the workspace, and `summarise`
# (the rows without the profile tables, which go to OUT/NAME.txt, NAME the verb's name).
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
summarise() {
    "$PY" -c "
import json
for line in open('$OUT/rows.jsonl'):
    r = json.loads(line)
    if r['verb'] == 'profile':
        open('$OUT/' + r['name'] + '.txt', 'w').write(r['by_device'] + '\n' + r['by_host'])
        continue
    print(json.dumps({k: v for k, v in r.items() if k not in ('by_device', 'by_host')})[:900])
" | tee -a "$OUT/summary.txt"
}
