# ruff: noqa  -- the calibration workspaces of docs/results/process-supervision.md (2026-11-27, second batch), kept as they ran
"""Tiny multistep workspace for issue 29: prepare, SFT, PRM; prints SFT and PRM held-out figures.
Run: OMP_NUM_THREADS=1 [NO_RM=1] python docs/measurements/process_tiny_calibration.py DIR [KEY=VALUE ...]"""
import sys, yaml, os, json, time
sys.path.insert(0, "/work/main")
from tests.tiny import TINY_DEMO, tiny_params
from rlhf_core.stages.prepare import prepare
from rlhf_core.trainers.sft import train_sft
from rlhf_core.trainers.rm import train_rm
root = sys.argv[1]
extra = sys.argv[2:]
os.makedirs(root, exist_ok=True)
M = [*TINY_DEMO, "data.source=multistep", "data.multistep.n_train=12000", "data.multistep.n_held_out=600",
     "data.multistep.min_ops=2", "data.multistep.max_ops=3", "data.multistep.max_operand=9",
     "data.max_prompt_len=40", "data.max_response_len=40",
     "model.tiny.max_position_embeddings=96", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
     "model.tiny.num_hidden_layers=4", "model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=4",
     "sft.epochs=4", "rm.objective=process", "rm.micro_batch_size=32",
     "rm.lr=0.003", "rm.warmup_steps=5", "rm.log_every=20", "rm.epochs=4", "eval.max_prompts=200", "eval.max_new_tokens=40",
     "eval.checker=final_number",
     "rlhf.algorithm=grpo", "rlhf.reward_fns={rm: 1.0}", "rlhf.prompts_per_step=8", "rlhf.grpo.group_size=8",
     "rlhf.max_new_tokens=40", "rlhf.micro_batch_size=32", "rlhf.num_steps=40", "rlhf.log_every=10", "rlhf.save_every=0",
     "rlhf.lr=1e-4", "rlhf.grpo.beta=0.1", "rlhf.warmup_steps=0", "rlhf.lr_scheduler=constant", *extra]
p = tiny_params(M)
t0 = time.time(); prepare(p, root); t1 = time.time()
s = train_sft(p, root); t2 = time.time()
print("SFT", json.dumps({k: v for k, v in s.items() if not isinstance(v, (list, dict))}), f"{t2-t1:.0f}s", flush=True)
if os.environ.get("NO_RM") != "1":
    m = train_rm(p, root); t3 = time.time()
    print("RM", json.dumps({k: m.get(k) for k in ("accuracy", "step_accuracy", "step_accuracy_wrong", "step_loss_before", "step_loss", "unlabelled_rows", "n_train")}), f"{t3-t2:.0f}s", flush=True)
yaml.safe_dump(p.model_dump(mode="json"), open(root + "/params.yaml", "w"), sort_keys=False)
