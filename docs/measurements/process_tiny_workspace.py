# ruff: noqa  -- the workspace behind docs/results/process-supervision.md, kept as it ran (batch 3: max_ops 2, min_ops 2, sft.epochs 20)
import sys, yaml, os, json
sys.path.insert(0, "/work/main")
from tests.tiny import TINY_DEMO, tiny_params
from rlhf_core.stages.prepare import prepare
from rlhf_core.trainers.sft import train_sft
from rlhf_core.trainers.rm import train_rm
root = "/tmp/pw/ws"
os.makedirs(root, exist_ok=True)
M = [*TINY_DEMO, "data.source=multistep", "data.multistep.n_train=3000", "data.multistep.n_held_out=300",
     "data.multistep.max_ops=3", "data.multistep.max_operand=9", "data.max_prompt_len=40", "data.max_response_len=40",
     "model.tiny.max_position_embeddings=96", "sft.epochs=10", "rm.objective=process", "rm.micro_batch_size=32",
     "rm.lr=0.003", "rm.warmup_steps=5", "rm.log_every=20", "rm.epochs=6", "eval.max_prompts=100", "eval.max_new_tokens=40",
     "eval.checker=final_number",
     "rlhf.algorithm=grpo", "rlhf.reward_fns={rm: 1.0}", "rlhf.prompts_per_step=8", "rlhf.grpo.group_size=8",
     "rlhf.max_new_tokens=40", "rlhf.micro_batch_size=32", "rlhf.num_steps=40", "rlhf.log_every=10", "rlhf.save_every=0",
     "rlhf.lr=5e-4", "rlhf.grpo.beta=0.04", "rlhf.warmup_steps=0", "rlhf.lr_scheduler=constant"]
p = tiny_params(M)
prepare(p, root); train_sft(p, root); m = train_rm(p, root)
print(json.dumps({k: m.get(k) for k in ("accuracy", "step_accuracy", "step_accuracy_wrong", "step_loss_before", "step_loss", "unlabelled_rows", "n_train")}))
yaml.safe_dump(p.model_dump(mode="json"), open(root + "/params.yaml", "w"), sort_keys=False)
