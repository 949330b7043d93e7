"""The DeepSpeed engine: config, schedule, value head, losses by hand, resume with the same data order, NaN guard."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.algos import divergence_rm_loss, gather_last, last_valid_index, pairwise_rm_loss, token_nll
from rlhf_core.config import ComputeConfig, EpochConfig, OptimConfig
from rlhf_core.engine import (
    CheckpointManager,
    Hooks,
    NonFiniteLossError,
    ResumableSampler,
    StepPlan,
    TrainEngine,
    TrainState,
    WarmupDecay,
    build_ds_config,
    fit,
)
from rlhf_core.models import RewardScorer, ValueHeadModel
from rlhf_core.ops.atomic import atomic_dir

VOCAB = 40


def tiny_llama(seed: int = 0, causal: bool = True, vocab: int = VOCAB):
    from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return (AutoModelForCausalLM if causal else AutoModel).from_config(cfg)


# --------------------------------------------------------------------------- pure pieces
def test_pairwise_loss_matches_hand_values():
    loss, stats = pairwise_rm_loss(torch.tensor([1.0]), torch.tensor([0.0]))
    assert loss.item() == pytest.approx(0.31326, abs=1e-5)  # -log sigmoid(1)
    loss, stats = pairwise_rm_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), margin=0.5)
    expected = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(1.5))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["accuracy"].item() == 0.5 and stats["margin_mean"].item() == 0.0


def test_divergence_loss_matches_hand_computation():
    # pair 0: ids differ from position 2; lengths 4 and 3 -> positions 2, 3
    # pair 1: identical rows -> only the last token (log 2)
    cid = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0]])
    rid = torch.tensor([[5, 6, 4, 0, 0], [5, 6, 9, 0, 0]])
    cm, rm = (cid != 0).long(), (rid != 0).long()
    cv = torch.tensor([[0.0, 0.0, 1.0, 2.0, 9.0], [0.3, 0.3, 0.3, 9.0, 9.0]])
    rv = torch.tensor([[0.0, 0.0, 0.0, 0.0, -9.0], [0.3, 0.3, 0.3, 9.0, 9.0]])

    def nls(x):
        return math.log1p(math.exp(-x))

    pair0 = (nls(1.0) + nls(2.0)) / 2
    expected = (pair0 + math.log(2)) / 2
    assert divergence_rm_loss(cv, rv, cid, rid, cm, rm).item() == pytest.approx(expected, abs=1e-6)


def test_end_token_gather_with_left_and_right_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    assert last_valid_index(right).tolist() == [1, 3, 0]
    assert gather_last(x, right).tolist() == [2.0, 8.0, 9.0]
    assert last_valid_index(left).tolist() == [3, 3, 3]
    assert gather_last(x, left).tolist() == [4.0, 8.0, 12.0]


def test_value_head_scores_do_not_depend_on_padding_side():
    model = ValueHeadModel(tiny_llama(causal=False)).eval()
    rows = [[5, 6, 7, 8, 2], [9, 10, 2], [11, 2]]
    T = 5
    right = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    left = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    with torch.no_grad():
        s_right = model(right, (right != 0).long()).scores
        s_left = model(left, (left != 0).long()).scores
        s_alone = torch.stack([model(torch.tensor([r])).scores[0] for r in rows])
        out = model(right, (right != 0).long())
    assert out.values.shape == (3, T)
    torch.testing.assert_close(s_right, s_alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_left, s_alone, atol=1e-5, rtol=1e-4)


def test_token_nll_counts_only_labelled_tokens():
    logits = torch.zeros(1, 4, 3)  # uniform -> each token costs log 3
    labels = torch.tensor([[-100, 1, -100, 2]])
    s, n = token_nll(logits, labels)
    assert n.tolist() == [2] and s.item() == pytest.approx(2 * math.log(3))


def test_warmup_then_cosine_decay():
    f = WarmupDecay(warmup=4, total=14, kind="cosine", min_ratio=0.1)
    assert [round(f(s), 3) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0) and f(14) == pytest.approx(0.1) and f(9) == pytest.approx(0.55)
    assert WarmupDecay(0, 10, "linear")(5) == pytest.approx(0.5)
    assert WarmupDecay(2, 10, "constant")(7) == 1.0


def test_ds_config_from_params():
    optim = OptimConfig(micro_batch_size=4, grad_accum=2)
    cfg = build_ds_config(ComputeConfig(zero_stage=3, offload="cpu", grad_clip=0.5), optim, world_size=2)
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 2
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert z["stage3_gather_16bit_weights_on_model_save"] is True and cfg["gradient_clipping"] == 0.5
    cfg0 = build_ds_config(ComputeConfig(zero_stage=0), optim, world_size=1, precision="fp32")
    assert cfg0["gradient_clipping"] == 0.0  # ZeRO-0 fp32: the engine clips and measures itself
    assert not cfg0["bf16"]["enabled"] and not cfg0["fp16"]["enabled"]



def test_bf16_master_weights_and_moments():
    """``bf16_master``: DeepSpeed's two bf16 keys in bf16, nothing in fp32 (the CPU), and ZeRO-0 refused."""
    optim = OptimConfig(micro_batch_size=4, grad_accum=2)
    compute = ComputeConfig(zero_stage=1, bf16_master=True)
    assert build_ds_config(compute, optim, world_size=1, precision="bf16")["bf16"] == {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert build_ds_config(compute, optim, world_size=1, precision="fp32")["bf16"] == {"enabled": False}
    assert build_ds_config(ComputeConfig(zero_stage=1), optim, 1, precision="bf16")["bf16"] == {"enabled": True}
    with pytest.raises(ValueError, match="bf16_master needs zero_stage >= 1"):
        ComputeConfig(bf16_master=True)


def test_sampler_is_deterministic_and_sharded():
    plan = StepPlan(n_examples=10, micro_batch_size=2, grad_accum=1, world_size=2, epochs=2)
    s0, s1 = ResumableSampler(plan, seed=3, rank=0), ResumableSampler(plan, seed=3, rank=1)
    assert plan.micro_batches_per_epoch == 3 and plan.total_steps == 6
    epoch0 = torch.cat([s0.batch(m) for m in range(3)] + [s1.batch(m) for m in range(3)])
    assert sorted(epoch0.tolist()) == list(range(10))  # each example once per epoch across ranks
    again = ResumableSampler(plan, seed=3, rank=0)
    assert [again.batch(m).tolist() for m in (4, 0)] == [s0.batch(4).tolist(), s0.batch(0).tolist()]
    assert s0.batch(3).tolist() != s0.batch(0).tolist()  # a new order each epoch


def test_atomic_dir_keeps_the_old_model_when_saving_fails(tmp_path):
    target = tmp_path / "models" / "sft"
    with atomic_dir(target) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "weights").write_text("half")
        raise RuntimeError("crash while saving")
    assert (target / "weights").read_text() == "v1"
    assert [p.name for p in target.parent.iterdir()] == ["sft"]


# --------------------------------------------------------------------------- training loop
N_EXAMPLES = 24
DATA = torch.randint(3, VOCAB, (N_EXAMPLES, 8), generator=torch.Generator().manual_seed(0))


def lm_loss(engine, batch):
    out = engine(input_ids=batch, labels=batch)
    return out.loss, {"tokens": torch.tensor(float(batch.numel()))}


def run_loop(root, steps_before_crash=None, save_every=2, loss_fn=lm_loss, resume=True, dropout=0.1):
    """Train the tiny LM; returns (losses by step, micro-batches seen, state)."""
    optim = EpochConfig(lr=5e-3, warmup_steps=2, epochs=3, micro_batch_size=4, grad_accum=2, save_every=save_every)
    compute = ComputeConfig(zero_stage=0)
    plan = StepPlan(N_EXAMPLES, optim.micro_batch_size, optim.grad_accum, 1, optim.epochs)
    model = tiny_llama()
    model.config.attention_dropout = dropout  # randomness the RNG restore must reproduce
    engine = TrainEngine(model, compute, optim, plan.total_steps)
    ckpt = CheckpointManager(root / "checkpoints" / "toy", {"toy": 1}, keep=1)
    tag = ckpt.prepare(resume)
    state = TrainState.from_json(ckpt.load(engine, tag)) if tag else TrainState()
    if not tag:
        torch.manual_seed(123)
    seen, losses = {}, {}

    def after_step(step, metrics):
        losses[step] = metrics["loss"]
        if steps_before_crash is not None and step == steps_before_crash:
            raise KeyboardInterrupt("simulated crash")

    hooks = Hooks(on_batch=lambda m, idx: seen.__setitem__(m, idx.tolist()), after_step=after_step)
    with contextlib.suppress(KeyboardInterrupt):  # the simulated crash
        state = fit(engine, plan, ResumableSampler(plan, 7, 0), lambda idx: DATA[idx], loss_fn, state, ckpt,
                    None, save_every=optim.save_every, hooks=hooks)
    return losses, seen, state, ckpt


def test_resume_continues_with_the_same_data_order_and_losses(tmp_path):
    full_losses, full_seen, full_state, _ = run_loop(tmp_path / "a")
    total = full_state.step
    assert total == 9  # 3 epochs x 6 micro-batches / accum 2

    crashed_losses, _, _, ckpt = run_loop(tmp_path / "b", steps_before_crash=5)
    assert max(crashed_losses) == 5 and ckpt.latest_tag() == "step_00000004"  # save_every=2: step 5 not saved
    resumed_losses, resumed_seen, resumed_state, _ = run_loop(tmp_path / "b")
    assert min(resumed_losses) == 5  # continued after step 4, not restarted
    assert resumed_seen == {m: full_seen[m] for m in range(8, 18)}  # same batches as the uninterrupted run
    for step in range(5, total + 1):
        assert resumed_losses[step] == pytest.approx(full_losses[step], rel=1e-5, abs=1e-6)
    assert resumed_state.step == total and len(resumed_state.curve) == total
    assert [r["step"] for r in resumed_state.curve] == list(range(1, total + 1))


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    calls = {"n": 0}

    def nan_at_step_4(engine, batch):
        calls["n"] += 1
        loss, stats = lm_loss(engine, batch)
        return (loss * float("nan") if calls["n"] > 6 else loss), stats  # accum 2: step 4 = micro 7

    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at optimizer step 4.*step_00000002"):
        run_loop(tmp_path, loss_fn=nan_at_step_4, dropout=0.0)
    ckpt = CheckpointManager(tmp_path / "checkpoints" / "toy", {"toy": 1})
    assert ckpt.latest_tag() == "step_00000002"


def test_changed_fingerprint_starts_afresh(tmp_path):
    run_loop(tmp_path, steps_before_crash=2)
    stale = CheckpointManager(tmp_path / "checkpoints" / "toy", {"toy": 2})
    assert stale.prepare(resume=True) is None
    assert stale.latest_tag() is None


def test_value_model_save_load_and_scorer(tmp_path):
    from rlhf_core.data.tokenizer import train_demo_tokenizer

    tok = train_demo_tokenizer(["Human: What is 1 + 2?\n\nAssistant: 3"] * 20, 64)
    model = ValueHeadModel(tiny_llama(causal=False, vocab=len(tok))).eval()
    model.save_pretrained(tmp_path / "rm", tok.pad_token_id)
    tok.save_pretrained(tmp_path / "rm")
    saved = {p.name for p in (tmp_path / "rm").iterdir()}
    assert "model.safetensors" in saved and "value_head.safetensors" not in saved
    loaded = ValueHeadModel.from_pretrained(tmp_path / "rm", require_head=True)
    torch.testing.assert_close(loaded.value_head.weight, model.value_head.weight)
    scorer = RewardScorer.from_pretrained(tmp_path / "rm", device="cpu")
    texts = ["Human: What is 1 + 2?\n\nAssistant: 3", "Human: What is 1 + 2?\n\nAssistant: 4", "x"]
    scores = scorer.score(texts)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    one = scorer.score(texts[1:2])
    assert one[0].item() == pytest.approx(scores[1].item(), abs=1e-5)  # batching/padding does not change a score
    pr = scorer.score_responses(["Human: What is 1 + 2?\n\nAssistant:"], [" 3"])
    assert pr.shape == (1,)


LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child Python process: the repository importable, no launcher's keys (a bare
    process, whatever ran this test), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    return env | {"PYTHONPATH": str(Path(__file__).resolve().parents[3])} | extra


def test_a_world_of_one_neither_builds_nor_loads_the_shm_op(tmp_path):
    """A single process runs no collective between local ranks: DeepSpeed's CPU backend gets no shared-memory op
    (nothing is built in an empty ``TORCH_EXTENSIONS_DIR``) and the patched name is restored; bare and under a
    launcher's world of one. (Every engine test here trains in such a world.)"""
    env = child_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = ("import importlib; T = importlib.import_module('deepspeed.comm.torch'); original = T.build_shm_op; "
            "from rlhf_core.engine import distributed as D; D.init_distributed(); "
            "import deepspeed.comm.comm as C; "
            "print('op', C.cdb.shm_comm_op, 'restored', T.build_shm_op is original, 'world', D.world_size())")
    launched = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29533"}
    for extra in ({}, launched):
        proc = subprocess.run([sys.executable, "-c", code], env=env | extra, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "op None restored True world 1" in proc.stdout, proc.stdout
        assert not [p for p in (tmp_path / "ext").rglob("*") if p.is_file()]  # the engine's guard may make a folder


def test_the_process_group_is_destroyed_when_the_process_exits():
    """torch warns on NCCL that a group left at exit can leak resources: ``init_distributed`` registers
    ``shutdown``. A check registered before it runs after it (atexit is last in, first out)."""
    env = child_env()
    code = ("import atexit, torch.distributed as dist; "
            "atexit.register(lambda: print('at exit, initialised:', dist.is_initialized())); "
            "from rlhf_core.engine import distributed as D; D.init_distributed(); "
            "print('running, initialised:', dist.is_initialized()); D.shutdown(); D.shutdown(); D.init_distributed()")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "running, initialised: True" in proc.stdout
    assert "at exit, initialised: False" in proc.stdout
