"""A group's prompt once and its responses packed after it in one row (rlhf_core/passes/group_packing.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.passes import group_packing
from rlhf_core.passes.generation import response_logits, response_mask, shared_prefix_split
from rlhf_core.passes.group_packing import pack_groups, supports_packing

PAD, EOS = 0, 2
T, F = True, False

# two prompts (3 and 4 real tokens) with 2 and 3 samples; responses of 3, 1, 2, 3 (no EOS) and 1 tokens
PROMPTS = torch.tensor([[PAD, 1, 7, 8], [1, 7, 9, 5]])
GROUP = torch.tensor([0, 0, 1, 1, 1])
RESPONSES = torch.tensor([[4, 5, EOS], [EOS, PAD, PAD], [6, EOS, PAD], [9, 9, 9], [EOS, PAD, PAD]])


def _rows():
    seq = torch.cat([PROMPTS[GROUP], RESPONSES], dim=1)
    att = torch.cat([(PROMPTS[GROUP] != PAD).long(), response_mask(RESPONSES, EOS)], dim=1)
    return seq, att


def _tiny_lm(attn: str = "sdpa", kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    config._attn_implementation = attn
    return LlamaForCausalLM(config)


def test_packed_rows_by_hand():
    seq, att = _rows()
    first, owner, _ = shared_prefix_split(seq, att, 3, GROUP)
    p = pack_groups(seq, att, 3, first, owner)
    # row 0: prompt 1 7 8, then [4 5] (the response 4 5 EOS but its last token), nothing of the EOS-only response
    # row 1: prompt 1 7 9 5, then [6] and [9 9]
    assert p.input_ids.tolist() == [[1, 7, 8, 4, 5, 0, 0], [1, 7, 9, 5, 6, 9, 9]]
    # each response token at the position it has in its own row: prompt length + k
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0], [0, 1, 2, 3, 4, 4, 5]]
    # the logit scoring token k: the prompt's last column for k = 0, else the column of token k - 1 (flat u * 7 + w)
    assert p.index.tolist() == [[2, 3, 4], [2, 0, 0], [10, 11, 7], [10, 12, 13], [10, 7, 7]]
    assert p.valid.tolist() == [[T, T, T], [T, F, F], [T, T, F], [T, T, T], [T, F, F]]
    m = p.attention_mask[:, 0]
    assert m[1, 5].tolist() == [T, T, T, T, F, T, F]  # the second 9 of [9 9]: the prompt and itself, not [6]
    assert m[1, 6].tolist() == [T, T, T, T, F, T, T]
    assert m[1, 4].tolist() == [T, T, T, T, T, F, F]
    assert m[0, 5].tolist() == [F, F, F, F, F, T, F]  # padding attends to itself only (no all-masked row)
    assert m[0, 2].tolist() == [T, T, T, F, F, F, F]  # the prompt is causal


def _recorded_runner(model, seq, att, m, objective, temperature: float = 1.0):
    """``run(group, pack) -> (logits, grads)`` over the response logits, and the list of the model's call shapes
    (input_ids) of the last run."""
    calls = []
    model.model.register_forward_pre_hook(lambda mod, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                          with_kwargs=True)

    def run(group, pack):
        model.zero_grad()
        calls.clear()
        logits = response_logits(model, seq, att, 3, temperature=temperature, group=group, pack=pack)
        (objective(logits) * m[..., None]).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    return run, calls


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
def test_packed_logits_and_gradients_are_the_full_forwards_in_one_pass(kv_heads):
    seq, att = _rows()
    model = _tiny_lm(kv_heads=kv_heads)
    m = att[:, -3:].bool()
    run, calls = _recorded_runner(model, seq, att, m, lambda x: x, temperature=0.7)

    full, full_grads = run(None, False)
    packed, packed_grads = run(GROUP, True)
    assert calls == [(2, 7)]  # one pass: 5 + 7 positions instead of 5 x 6
    torch.testing.assert_close(packed[m], full[m], atol=1e-5, rtol=1e-5)
    assert packed[~m].abs().sum() == 0
    for a, b in zip(full_grads, packed_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_models_without_sdpa_and_rows_past_the_width_bound_share_the_prompt_cache_instead(monkeypatch):
    seq, att = _rows()
    calls = []

    def shapes(model, **kwargs):
        model.zero_grad()
        calls.clear()
        hook = model.model.register_forward_pre_hook(
            lambda mod, a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        logits = response_logits(model, seq, att, 3, group=GROUP, pack=True)
        hook.remove()
        return logits, list(calls)

    eager = _tiny_lm("eager")
    assert not supports_packing(eager)
    logits, cache_calls = shapes(eager)
    assert len(cache_calls) > 1 and cache_calls[0][0] == 1  # the common head once, then the prompts, the suffixes
    full = response_logits(eager, seq, att, 3)
    torch.testing.assert_close(logits[att[:, -3:].bool()], full[att[:, -3:].bool()], atol=1e-5, rtol=1e-5)

    sdpa = _tiny_lm()
    assert shapes(sdpa)[1] == [(2, 7)]
    monkeypatch.setattr(group_packing, "PACK_MAX_WIDTH", 6)
    monkeypatch.setattr("rlhf_core.passes.generation.PACK_MAX_WIDTH", 6)
    assert len(shapes(sdpa)[1]) > 1


def test_supports_packing_looks_through_wrappers():
    class Wrapper:
        def __init__(self, module):
            self.module = module

    assert supports_packing(Wrapper(Wrapper(_tiny_lm())))
    assert not supports_packing(Wrapper(_tiny_lm("eager")))
    assert not supports_packing(object())


@pytest.mark.parametrize("pack", [True, False])
def test_rows_of_one_group_with_different_prompts_are_refused(pack):
    seq, att = _rows()
    with pytest.raises(ValueError, match="different prompts"):
        response_logits(_tiny_lm(), seq, att, 3, group=torch.tensor([0, 0, 0, 1, 1]), pack=pack)


@pytest.mark.parametrize("arch", ["sliding_window", "conv_layer"])
def test_models_that_do_more_than_attend_get_the_plain_forward_and_say_so_once(arch, caplog):
    """A 4-token sliding window counts columns, which packing moves; a convolution runs along the packed row
    across the responses. Both were packed (log-probs 1.67 and 0.26 nats off on real models) and the LFM2's
    cache fallback crashed: now every pass over them is the plain forward, logged once."""
    from rlhf_core.passes.prefix_cache import warn_once
    from tests.tiny import tiny_lm

    warn_once.cache_clear()  # once per process: forget what earlier tests said
    seq, att = _rows()
    model = tiny_lm(arch)
    m = att[:, -3:].bool()
    run, calls = _recorded_runner(model, seq, att, m, lambda x: x.log_softmax(-1))

    full, full_grads = run(None, False)
    for pack in (True, True, False):
        out, grads = run(GROUP, pack)
        assert calls == [(5, 6)]  # one plain forward over the full rows (but their last token)
        torch.testing.assert_close(out[m], full[m], atol=1e-5, rtol=1e-5)
        for a, b in zip(full_grads, grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    reason = "sliding window 4" if arch == "sliding_window" else "layer types ['conv']"
    assert [s for s in said if s.startswith("group packing is off")] == [
        f"group packing is off for model type {model.config.model_type} ({reason}): the groups share the prompt's "
        "cache or go through whole"]
    assert sum(s.startswith("the shared prompt cache is off") for s in said) == 1


def test_a_mistral_without_a_window_is_packed():
    from tests.tiny import tiny_lm

    seq, att = _rows()
    model = tiny_lm("full_window")
    m = att[:, -3:].bool()
    calls = []
    model.model.register_forward_pre_hook(lambda mod, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                          with_kwargs=True)
    packed = response_logits(model, seq, att, 3, group=GROUP, pack=True)
    assert calls == [(2, 7)]
    torch.testing.assert_close(packed[m], response_logits(model, seq, att, 3)[m], atol=1e-5, rtol=1e-5)


def test_which_configs_are_packed():
    from types import SimpleNamespace

    from transformers import AutoConfig

    def packs(model_type, attn="sdpa", **kwargs):
        config = AutoConfig.for_model(model_type, **kwargs)
        config._attn_implementation = attn
        return supports_packing(SimpleNamespace(config=config))

    assert packs("llama") and packs("qwen2") and packs("mixtral") and packs("mistral", sliding_window=None)
    assert packs("qwen2", sliding_window=4096, use_sliding_window=False)  # a window named but not used
    assert packs("lfm2", layer_types=["full_attention"] * 2, num_hidden_layers=2)  # attention only
    assert not packs("llama", attn="eager")
    assert not packs("mistral")  # sliding_window 4096 by default
    assert not packs("phi3", sliding_window=2047)
    assert not packs("gemma2") and not packs("gpt_oss")  # sliding_attention layers
    assert not packs("lfm2", layer_types=["conv", "full_attention"], num_hidden_layers=2)
    assert not packs("qwen3_next") and not packs("mamba") and not packs("jamba")  # linear attention / SSM layers
    assert not packs("rwkv")  # recurrent, no layer_types at all


def test_rows_past_the_width_bound_never_build_the_mask(monkeypatch):
    """The packed width is decided from the lengths before the ``[U, 1, W, W]`` mask is built: a group of four
    150-token responses packs to W = 3 + 4 x 149 = 599 columns, past a bound of 64, and no boolean tensor of
    ``W^2`` elements is ever allocated (the fall-back used to build the mask first: +240 MB at W = 5602)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhf_core.passes.group_packing import packed_width

    class LargestBool(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                    LargestBool.numel = max(LargestBool.numel, t.numel())
            return out

    monkeypatch.setattr("rlhf_core.passes.generation.PACK_MAX_WIDTH", 64)
    prompt = torch.tensor([[PAD, 1, 7, 8]]).repeat(4, 1)
    responses = torch.randint(3, 16, (4, 150), generator=torch.Generator().manual_seed(0))
    seq = torch.cat([prompt, responses], dim=1)
    att = (seq != PAD).long()
    group = torch.zeros(4, dtype=torch.long)
    first, owner, _ = shared_prefix_split(seq, att, 150, group)
    assert packed_width(att, 150, first, owner) == 599
    model = _tiny_lm()
    with torch.no_grad(), LargestBool():
        out = response_logits(model, seq, att, 150, group=group, pack=True)
    assert LargestBool.numel < 599 * 599
    torch.testing.assert_close(out, response_logits(model, seq, att, 150), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_two_zero3_ranks_with_unequal_rows_make_the_same_forward_passes(tmp_path):
    """Under ZeRO-3 every forward all-gathers the parameters, so ranks that made different passes hung. Two
    ranks on CPU (gloo) get rows that alone would take different paths (tests/zero3_ranks.py): packed or
    not, a common head or not, one length bucket or two, a shared prompt or none, a shared prefill or not,
    the experience passes in one slice of rows or three, a reward model's pair layout worth sharing or not. Both
    finish, make the same passes, and the actor's logits, the critic's values and the RM's scores equal each
    rank's plain forward."""
    repo = Path(__file__).resolve().parents[3]
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
           str(repo / "tests/zero3_ranks.py"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun stops its workers
        _, err = proc.communicate(timeout=120)
        pytest.fail(f"the ranks hung: unequal forward passes under ZeRO-3\n{err[-3000:]}")
    assert proc.returncode == 0, err[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0.keys() == r1.keys() == {"pack", "head", "buckets", "no_group", "slices", "prefill", "pair_layout"}
    for case in r0:
        assert len(r0[case]["passes"]) == len(r1[case]["passes"]), (case, r0[case], r1[case])
        assert max(r0[case].get("max_diff", 0), r1[case].get("max_diff", 0)) < 1e-5, case
    # what every rank agreed to: the prompt's cache where one rank's row is too wide to pack; no head where one
    # rank's prompts part at their first token; one bucket where one rank's rows are all one length; the plain
    # forward where one rank has nothing to share; no shared prefill where one rank's prefix is all padding
    assert [len(r0[c]["passes"]) for c in ("pack", "head", "buckets", "no_group")] == [2, 2, 2, 1]
    # the experience in slices of 2 rows: the first through the prompt's cache (two passes); rank 1 has no
    # second or third, and runs its last row again (one plain pass each; then no rank shares)
    assert len(r0["slices"]["passes"]) == 4
    assert r0["prefill"] == r1["prefill"] == {"passes": [], "cache": False}
    # the RM's pairs: rank 1's layout is not worth sharing, so both score the full rows, in one pass each
    assert r0["pair_layout"]["passes"] == [[4, 10]] == r1["pair_layout"]["passes"]


def test_a_checkpointed_training_forward_packs_or_runs_whole_rows_never_the_shared_cache(monkeypatch):
    """Gradient checkpointing re-runs each layer's forward in backward, which would append to a shared prompt
    cache again. In a training forward under checkpointing the groups are packed (one pass: the full forwards'
    logits and gradients), and where packing does not apply (past the width bound) the rows go through whole;
    without gradients (the log-prob passes) the cache is shared as before. The critic's values likewise."""
    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.passes.values import sequence_values

    seq, att = _rows()
    m = att[:, -3:].bool()
    full, full_grads = _recorded_runner(_tiny_lm(), seq, att, m, lambda x: x)[0](None, False)
    model = _tiny_lm()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    run, calls = _recorded_runner(model, seq, att, m, lambda x: x)
    for width, passes in ((1 << 16, [(2, 7)]), (6, [(5, 6)])):  # packed; past the bound: whole rows
        monkeypatch.setattr("rlhf_core.passes.generation.PACK_MAX_WIDTH", width)
        logits, grads = run(GROUP, True)
        assert calls == passes
        torch.testing.assert_close(logits[m], full[m], atol=1e-5, rtol=1e-5)
        for a, b in zip(full_grads, grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    calls.clear()
    with torch.no_grad():
        response_logits(model, seq, att, 3, group=GROUP, pack=True)
    assert len(calls) > 1 and calls[0][0] == 1  # the common head once, then the prompts and the suffixes

    critic = ValueHeadModel(_tiny_lm().model)
    critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    critic.train()
    shapes = []
    critic.backbone.register_forward_pre_hook(lambda mod, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                              with_kwargs=True)
    values = sequence_values(critic, seq, att, 3, GROUP)
    values.sum().backward()
    assert shapes == [(5, 6)]
