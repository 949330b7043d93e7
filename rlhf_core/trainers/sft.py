"""Supervised fine-tuning on DeepSpeed: causal-LM loss on ``prompt + response + EOS``.

Prompt tokens are masked (label -100) unless ``sft.loss_on_prompt``; pad never counts.  Evaluation
before and after training: perplexity on ``eval_sft`` (exp of the mean NLL over response tokens) and
exact-answer accuracy of greedy completions on ``eval_prompts`` (``check_answer``).
``rlhf stage sft`` reads ``data/prepared/{sft,eval_sft,eval_prompts}.parquet`` and ``models/base``; writes
``models/sft/``, ``metrics/sft.json``, ``plots/sft_loss.csv``; resumable checkpoints in ``checkpoints/sft/``.
Runs in one process, or N under ``torchrun --nproc_per_node N -m rlhf_core.cli stage sft``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from rlhf_core.algos import token_nll
from rlhf_core.config import Params
from rlhf_core.data.collate import (
    SFTData,
    build_sft_data,
    collate_sft,
    encode_prompts,
    encode_sequences,
)
from rlhf_core.engine import distributed as D
from rlhf_core.engine.engine import TrainEngine
from rlhf_core.engine.loop import Hooks, LogFn, fit
from rlhf_core.engine.sampler import ResumableSampler
from rlhf_core.evaluation import HeldOut, heldout_eval, shard_for_eval
from rlhf_core.models.loading import (
    base_model_source,
    build_causal_lm,
    load_training_tokenizer,
    save_causal_lm,
)
from rlhf_core.ops import paths
from rlhf_core.trainers.common import (
    build_engine,
    checkpoints_for,
    default_max_length,
    finish_stage,
    input_hashes,
    read_split,
    resume_or_start,
    run_metrics,
    stage_meta,
)

STAGE = "sft"


def sft_loss(engine, batch: dict) -> tuple[torch.Tensor, dict]:
    """Mean token NLL over the labelled tokens of a micro-batch (transformers' shifted CE)."""
    n_tokens = batch.pop("num_tokens")
    out = engine(**{k: v.to(engine.device) for k, v in batch.items()}, use_cache=False)
    return out.loss, {"tokens": n_tokens.float()}


@torch.no_grad()
def eval_perplexity(model, data: SFTData, batch_size: int, pad_id: int, device) -> dict[str, float]:
    """Perplexity over response tokens: ``exp(sum NLL / n tokens)``, reduced over ranks."""
    was_training = model.training
    model.eval()
    idx, weight = shard_for_eval(len(data))
    nll, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for i in range(0, len(idx), batch_size):
        batch = collate_sft(data, idx[i:i + batch_size], pad_id)
        labels = batch.pop("labels").to(device)
        batch.pop("num_tokens")
        logits = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).logits
        s, n = token_nll(logits, labels)
        w = weight[i:i + batch_size].to(s.device)
        nll += (s.double() * w).sum().cpu()
        count += (n.double() * w).sum().cpu()
    model.train(was_training)
    total = D.all_reduce_sum(torch.stack([nll, count]))
    mean = float(total[0] / total[1].clamp(min=1))
    return {"eval_loss": mean, "ppl": math.exp(min(mean, 50.0))}


def _evaluate(engine: TrainEngine, params: Params, tokenizer, eval_data: SFTData, prompts: dict) -> dict:
    model, device = engine.module, engine.device
    synced = params.compute.zero_stage == 3 and D.world_size() > 1
    out = eval_perplexity(model, eval_data, params.eval.batch_size, tokenizer.pad_token_id, device)
    with_answer = [i for i, a in enumerate(prompts["answer"]) if a is not None]
    if with_answer:
        ev = params.eval
        texts = [prompts["prompt"][i] for i in with_answer][:ev.max_prompts]
        data = HeldOut(texts, [prompts["answer"][i] for i in with_answer][:ev.max_prompts],
                       encode_prompts(tokenizer, texts))
        gen = heldout_eval(model, tokenizer, data, ev, device, temperature=ev.temperature, synced_gpus=synced)
        out.update({"accuracy": gen["accuracy"], "eos_rate": gen["eos_share"]})
    else:
        out.update({"accuracy": None, "eos_rate": None})
    return out


def train_sft(params: Params, root: str | Path = ".", log: LogFn | None = None, hooks: Hooks | None = None) -> dict:
    """Run SFT under ``root``; returns the stage metrics (also written to ``metrics/sft.json``)."""
    t_start = time.perf_counter()
    root = Path(root)
    cfg, compute = params.sft, params.compute
    D.init_distributed()
    threads = D.set_num_threads(compute.num_threads)
    tokenizer = load_training_tokenizer(root, params)
    max_length = default_max_length(params, cfg.max_length)

    train = read_split(root, "sft", columns=("id", "prompt", "response"))
    evals = read_split(root, "sft", eval_split=True, columns=("id", "prompt", "response"))
    prompts = read_split(root, "prompts", eval_split=True, columns=("id", "prompt", "answer"))
    seqs = encode_sequences(tokenizer, train["prompt"], train["response"], max_length,
                            str(paths.prepared_file("sft")), "sft.max_length", train["id"])
    data = build_sft_data(seqs, cfg.loss_on_prompt, cfg.packing, max_length, params.project.seed)
    eval_seqs = encode_sequences(tokenizer, evals["prompt"], evals["response"], max_length,
                                 str(paths.prepared_file("sft", True)), "sft.max_length", evals["id"])
    eval_data = build_sft_data(eval_seqs, loss_on_prompt=False)

    source = base_model_source(params, root)
    plan, engine = build_engine(params, cfg, "sft.max_length", len(data), lambda: build_causal_lm(params, root), source,
                                tokenizer, max_length)

    files = [paths.prepared_file("sft"), paths.prepared_file("sft", True), paths.prepared_file("prompts", True)]
    inputs = input_hashes(root, files, {"init_model": paths.BASE_MODEL})
    ckpt = checkpoints_for(root, params, STAGE, cfg, inputs)
    state, resumed_from = resume_or_start(ckpt, engine, cfg.resume,
                                          lambda: _evaluate(engine, params, tokenizer, eval_data, prompts),
                                          params.project.seed)
    if log is not None and D.is_main():
        log({"n_train_rows": len(data), "n_examples": data.n_examples, "total_steps": plan.total_steps,
             "resumed_from_step": resumed_from, "truncated": data.truncated, "threads": threads}, state.step)

    pad_id = tokenizer.pad_token_id
    state = fit(engine, plan, ResumableSampler(plan, params.project.seed, D.rank()),
                lambda idx: collate_sft(data, idx, pad_id), sft_loss, state, ckpt, log,
                save_every=cfg.save_every, log_every=cfg.log_every, hooks=hooks)

    after = _evaluate(engine, params, tokenizer, eval_data, prompts)
    before = state.extra["before"]
    metrics = {
        "ppl_before": before["ppl"], "ppl_after": after["ppl"],
        "eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"],
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "eos_rate_before": before["eos_rate"], "eos_rate_after": after["eos_rate"],
        "n_train_examples": data.n_examples, "n_train_rows": len(data), "n_eval": len(eval_data),
        "truncated_train": data.truncated, "truncated_eval": eval_data.truncated,
        **run_metrics(state, resumed_from, engine, params, max_length),
    }
    meta = stage_meta(STAGE, params, inputs, base_model=source, lora=compute.lora.enabled,
                      merged=compute.lora.merge_on_save if compute.lora.enabled else None)
    return finish_stage(root, STAGE, engine, root / paths.SFT_MODEL,
                        lambda m, d: save_causal_lm(m, d, merge_lora=compute.lora.merge_on_save), tokenizer, meta,
                        metrics, ("sft_loss.csv", ("step", "loss")), state, t_start, log, params)
