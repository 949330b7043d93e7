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
source docs/measurements/gpu-grpo-common.sh
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
summarise
