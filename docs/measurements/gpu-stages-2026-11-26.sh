#!/bin/bash
# The pipeline's stages on a GPU (bf16, DeepSpeed), as they run on a CPU: a learning run from the RM, then
# ZeRO-3 and PPO for a few iterations. Run from the repo root; OUT gets one log per stage and the metrics.
#   GPU (2026-11-26, H200): wheels for what the image lacks in .gpuwheels (DeepSpeed from its sdist)
#   CPU, the same run for comparison:  TIMEOUT_SCALE=10 OUT=/tmp/cpu_stages bash docs/measurements/gpu-stages-2026-11-26.sh
set -u
export RLHF_TRACKING=off PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/stages_out}; mkdir -p "$OUT"
PY=${PY:-python3}
# the demo's params, smaller: 2 RMs of 8 epochs instead of 8 of 16, 60 RL iterations instead of 120
S=(-S rm.ensemble=2 -S rm.epochs=8 -S rlhf.num_steps=60 -S rlhf.log_every=10)
# EXTRA="-S k=v ...": more overrides (a quick dry run: EXTRA="-S sft.max_steps=5 -S rm.max_steps=5 -S rlhf.num_steps=2")
# shellcheck disable=SC2206
S+=(${EXTRA:-})
run() {  # run NAME TIMEOUT_S STAGE ARGS...: one stage, its log and its time; the next runs whatever this gave
    local name=$1 limit=$(( $2 * ${TIMEOUT_SCALE:-1} )); shift 2
    local t0; t0=$(date +%s.%N)
    timeout "$limit" "$PY" -m rlhf_core.cli stage "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $("$PY" -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a "$OUT/summary.txt"
    for m in metrics/*.json; do [ -f "$m" ] && cp "$m" "$OUT/$name.$(basename "$m")"; done 2>/dev/null
    rm -f metrics/*.json
}
"$PY" -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', 'transformers', transformers.__version__,
    'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee "$OUT/summary.txt"
run prepare 120 prepare "${S[@]}"
run sft 150 sft "${S[@]}"
run rm 200 rm "${S[@]}"
run rlhf_grpo 400 rlhf "${S[@]}"
run evaluate 120 evaluate "${S[@]}"
# RL_SEEDS="1 2": the same RL run again from these project.seed values (the seed spread)
for seed in ${RL_SEEDS:-}; do
    run "rlhf_grpo_s$seed" 400 rlhf "${S[@]}" -S project.seed="$seed" -S rlhf.resume=false
done
run rlhf_zero3 120 rlhf "${S[@]}" -S rlhf.num_steps=3 -S rlhf.resume=false -S compute.zero_stage=3
run rlhf_ppo 120 rlhf "${S[@]}" -S rlhf.num_steps=3 -S rlhf.resume=false -S rlhf.algorithm=ppo \
    -S rlhf.ppo.kl_in=loss -S rlhf.kl_estimator=k3 -S rlhf.kl_coef=0.2
# TORCHRUN=1: one process under the launcher (env:// rendezvous, as a Kubernetes job starts a stage)
if [ "${TORCHRUN:-0}" = 1 ]; then
    t0=$(date +%s.%N)
    timeout $(( 180 * ${TIMEOUT_SCALE:-1} )) "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m rlhf_core.cli stage rlhf "${S[@]}" \
        -S rlhf.num_steps=3 -S rlhf.resume=false > "$OUT/rlhf_torchrun.log" 2>&1
    echo "rlhf_torchrun rc=$? $("$PY" -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a "$OUT/summary.txt"
    cp metrics/rlhf.json "$OUT/rlhf_torchrun.rlhf.json" 2>/dev/null
fi
