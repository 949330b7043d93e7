#!/bin/bash
# Issue #31 on one GPU, in one run, fifth run: the rollout alone (static decoder with its CUDA graph, and with
# the model's forward compiled with GQA queries grouped over the KV heads, cfe6bc0) against the bandwidth bound;
# one GRPO iteration of ours (defaults) beside TRL's GRPOTrainer (bf16 weights) on the same machine; ours again
# with a snapshot of what the first training forward leaves alive (by the line that allocated it) and the
# resident memory; ours with the grouped compiled decode; ours with bf16 master weights and moments alone
# (ZeRO-1, no compile). Run from the repo root; OUT gets rows.jsonl, one log per verb and summary.txt. In order
# of priority: a verb past the call's limit loses only what follows it. Run 6, after the workload lost its
# ptx term (TRL has none) and the compiled step became the default on a GPU:
#   VERBS="ours trl ours_bf16 ours_mem ours_b trl_b ours_nocompile"
# Next GPU session (compute.lean_rmsnorm, 16b0811, measured on the CPU only):
#   VERBS="ours trl ours_plainnorm ours_mem ours_bf16 ours_b trl_b"   (run 7, H200)
# Run 8, the same H200 session (the compiled decode step's kernels, device time only; a third pair):
#   VERBS="profile ours_b trl_b"
# Next GPU session (rlhf.rollout_attention: product, the decode attention as two products, CPU-tested only):
#   VERBS="decode_product ours trl ours_product profile_product"
#   GPU: the wheels the image lacks in .whl (see gpu-grpo-2026-11-27b.sh), named in the call's carry
#   CPU rehearsal at toy size:  SMALL=1 OUT=/tmp/grpo_cpu PY=.venv/bin/python bash docs/measurements/gpu-grpo-2026-11-28.sh
source docs/measurements/gpu-grpo-common.sh
for v in ${VERBS:-decode ours trl ours_mem ours_compile ours_bf16}; do
    case $v in
        decode) verb decode 150 decode --engines static,static_compiled ;;
        ours) verb ours 120 ours --engine static ;;
        trl) verb trl 150 trl ;;
        ours_mem) verb ours_mem 120 ours --engine static --snapshot ;;
        ours_compile) verb ours_compile 150 ours --engine static --set rlhf.rollout_compile=true ;;
        ours_bf16) verb ours_bf16 120 ours --engine static --set compute.zero_stage=1 --set compute.bf16_master=true ;;
        ours_b) verb ours_b 120 ours --engine static ;;
        trl_b) verb trl_b 150 trl ;;
        ours_plainnorm) verb ours_plainnorm 120 ours --engine static --set compute.lean_rmsnorm=false ;;
        profile) verb profile 150 profile --engines static_compiled ;;
        profile_product) verb profile_product 150 profile --engines static_compiled_product ;;
        decode_product) verb decode_product 150 decode --engines static_compiled,static_compiled_product ;;
        ours_product) verb ours_product 120 ours --engine static --set rlhf.rollout_attention=product ;;
        ours_nocompile) verb ours_nocompile 120 ours --engine static --set rlhf.rollout_compile=false ;;
    esac
done
summarise
