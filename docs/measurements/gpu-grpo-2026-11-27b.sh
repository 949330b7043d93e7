#!/bin/bash
# Issue #31 on one GPU, in one run, third run (after the compiled decode step and the scoring passes' memory
# change): the rollout alone (static decoder with its CUDA graph, with and without the model's forward compiled)
# against the bandwidth bound; one GRPO iteration of ours with the defaults (static engine, compiled step) beside
# TRL's GRPOTrainer (bf16 weights) on the same random 0.5B Llama, prompts, reward and budget, with each phase's
# peak memory; then ours with bf16 master weights and moments (ZeRO-1), the per-kernel profile of the compiled
# step, ours without the compile, and ours with gradient checkpointing. Run from the repo root; OUT gets
# rows.jsonl, one log per verb, profile.txt and summary.txt. In order of priority: a verb past the call's limit
# loses only what follows it. Next GPU session (grouped compiled decode, 2026-11-27 evening):
#   VERBS="decode ours ours_compile trl ours_ckpt"
#   GPU: the wheels the image lacks in .whl (transformers 5.23.0, trl 1.16.0, datasets 5.2.0, dill, multiprocess,
#        pydantic + pydantic_core + annotated_types + typing_inspection, hjson, DeepSpeed 0.19.8 built here from
#        its sdist with `pip wheel --no-deps`), named in the call's carry
#   CPU rehearsal at toy size:  SMALL=1 OUT=/tmp/grpo_cpu PY=.venv/bin/python bash docs/measurements/gpu-grpo-2026-11-27b.sh
source docs/measurements/gpu-grpo-common.sh
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
        ours_compile) verb ours_compile 150 ours --engine static --set rlhf.rollout_compile=true ;;
    esac
done
summarise
