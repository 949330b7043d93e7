"""The real-text arithmetic task: the checker on hand-written answers, the held-out split by operand pair and by
phrasing, the generator's rows, and prepare's own held-out files (with a chat template, no model weights)."""

from __future__ import annotations

import random
import re

import pandas as pd
import pytest
import torch

from rlhf_core.rewards import get_checker, get_reward_fn
from rlhf_core.rewards.arithmetic import (
    PHRASINGS,
    check_final_number,
    demonstration,
    final_number,
    generate,
    is_held_out,
    near_miss,
    render_worked,
    solve,
    with_final_number,
)


@pytest.mark.parametrize("completion, answer", [("78", 78), ("78", "78"), ("The answer is 78.", "78"),
                                                 ("23 + 45 = 78", "78"), ("1,234", "1234"), ("-3", "-3"),
                                                 ("12 + 3 is 15\n", "15")])
def test_final_number_accepts(completion, answer):
    assert check_final_number(completion, answer)


@pytest.mark.parametrize("completion, answer", [("79", "78"), ("78 apples, no 79", "78"), ("seventy-eight", "78"),
                                                 ("", "78"), ("78", None), ("3", "-3"), ("7.8", "78")])
def test_final_number_rejects(completion, answer):
    assert not check_final_number(completion, answer)


def test_final_number_parse():
    assert final_number("23 + 45 = 68.") == 68 and final_number("none") is None and final_number("a -5") == -5


def test_checkers_by_name():
    assert get_checker("exact")(" 12", "12") and not get_checker("exact")("12 + 0 = 12", "12")
    assert get_checker("final_number")("12 + 0 = 12", "12")
    with pytest.raises(KeyError, match="eval.checker"):
        get_checker("fuzzy")
    assert get_reward_fn("final_number")([""] * 2, ["so 5", "6"], answer=["5", "5"]) == [1.0, 0.0]


def test_held_out_by_pair_and_by_phrasing():
    last = len(PHRASINGS["+"]) - 1
    assert is_held_out(3, "+", 4, last, seed=1, pair_share=0.0, held_out_phrasings=1)  # the held-out phrasing
    assert not is_held_out(3, "+", 4, 0, seed=1, pair_share=0.0, held_out_phrasings=1)
    assert is_held_out(3, "+", 4, 0, seed=1, pair_share=0.999999, held_out_phrasings=0)  # every pair held out
    pairs = [(a, b) for a in range(50) for b in range(50)]
    share = sum(is_held_out(a, "+", b, 0, 7, 0.2, 0) for a, b in pairs) / len(pairs)
    assert 0.17 < share < 0.23  # a fixed hash draws about the share asked


def render(messages):
    return f"<user>{messages[0]['content']}</user><assistant>"


def question(prompt: str) -> str:
    return prompt.removeprefix("<user>").removesuffix("</user><assistant>")


def test_generate_rows_are_consistent_and_split_apart():
    train, held = generate(600, 150, 99, ["+", "-"], seed=5, pair_share=0.15, held_out_phrasings=2, render=render)
    assert (train, held) == generate(600, 150, 99, ["+", "-"], seed=5, pair_share=0.15, held_out_phrasings=2,
                                     render=render)
    assert len(train) == 600 and len(held) == 150
    held_phrasings = {p for op in "+-" for p in PHRASINGS[op][-2:]}

    def parts(row):  # (a, op, b, phrasing) recovered from the question text
        q = question(row["prompt"])
        for op in "+-":
            for k, tpl in enumerate(PHRASINGS[op]):
                pattern = re.escape(tpl).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)")
                m = re.fullmatch(pattern, q)
                if m:
                    return int(m["a"]), op, int(m["b"]), k
        raise AssertionError(q)

    train_pairs = set()
    for row in train:
        a, op, b, k = parts(row)
        assert PHRASINGS[op][k] not in held_phrasings
        assert int(row["answer"]) == (a + b if op == "+" else a - b) >= 0
        assert row["response"] == row["chosen"] == row["answer"]  # one answer style: the bare result
        assert not check_final_number(row["rejected"], row["answer"])
        train_pairs.add((a, op, b))
    for row in held:
        a, op, b, k = parts(row)
        assert PHRASINGS[op][k] in held_phrasings or (a, op, b) not in train_pairs


@pytest.mark.parametrize("a, op, b, worked", [
    (23, "+", 45, "23 + 40 = 63, 63 + 5 = 68"), (38, "+", 27, "38 + 20 = 58, 58 + 7 = 65"),
    (45, "-", 7, "45 - 7 = 38"), (45, "-", 30, "45 - 30 = 15"), (45, "-", 0, "45 - 0 = 45"),
    (91, "-", 19, "91 - 10 = 81, 81 - 9 = 72"), (0, "+", 0, "0 + 0 = 0"), (5, "+", 120, "5 + 120 = 125"),
])
def test_worked_answers_by_hand(a, op, b, worked):
    assert render_worked(a, op, b) == worked == demonstration(a, op, b, "worked")
    assert demonstration(a, op, b, "result") == str(solve(a, op, b))


def test_worked_answers_end_in_the_result_for_every_pair():
    for a in range(100):
        for b in range(100):
            assert final_number(render_worked(a, "+", b)) == a + b
            if b <= a:
                assert final_number(render_worked(a, "-", b)) == a - b


def test_with_final_number_changes_only_the_last_integer():
    assert with_final_number("23 + 40 = 63, 63 + 5 = 68", 67) == "23 + 40 = 63, 63 + 5 = 67"
    assert with_final_number("68", 7) == "7"
    assert with_final_number("It is 68.", 69) == "It is 69."
    with pytest.raises(ValueError, match="states no integer"):
        with_final_number("sixty-eight", 67)
    with pytest.raises(ValueError, match="answer_style"):
        demonstration(1, "+", 2, "chain")


def test_worked_style_asks_the_same_questions_with_worked_answers():
    """The answer style changes the responses only: the same prompts, answers and split as the bare results; each
    rejected answer is the chosen one with a wrong last number."""
    result = generate(300, 60, 99, ["+", "-"], seed=5, pair_share=0.15, held_out_phrasings=2, render=render)
    worked = generate(300, 60, 99, ["+", "-"], seed=5, pair_share=0.15, held_out_phrasings=2, render=render,
                      answer_style="worked")
    for rows_r, rows_w in zip(result, worked, strict=True):
        assert [(r["id"], r["prompt"], r["answer"]) for r in rows_r] == [(r["id"], r["prompt"], r["answer"])
                                                                          for r in rows_w]
        for r, w in zip(rows_r, rows_w, strict=True):
            assert w["response"] == w["chosen"] and check_final_number(w["chosen"], w["answer"])
            assert " = " in w["chosen"]
            assert w["rejected"] == with_final_number(w["chosen"], int(r["rejected"]))  # the same near miss
            assert not check_final_number(w["rejected"], w["answer"])


def test_near_miss_is_wrong_and_not_negative():
    rng = random.Random(0)
    for correct in list(range(0, 200)) * 3:
        wrong = near_miss(rng, correct)
        assert wrong != correct and wrong >= 0


def test_generate_refuses_holding_out_every_phrasing():
    with pytest.raises(ValueError, match="held_out_phrasings"):
        generate(10, 5, 9, ["+"], 1, 0.1, len(PHRASINGS["+"]), render)


def test_prepare_writes_the_tasks_held_out_files(workspace, tiny_chat_tokenizer_dir):
    """prepare with `data.source: arithmetic` and a local tokenizer with a chat template (the tiny model is built
    from config, so nothing is imported): eval files hold exactly the generator's held-out questions."""
    from rlhf_core.stages.prepare import prepare
    from tests.conftest import make_params

    p = make_params("data.source=arithmetic", "data.arithmetic.n_train=300", "data.arithmetic.n_held_out=60",
                    "data.arithmetic.base_negatives=0", f"model.tokenizer={tiny_chat_tokenizer_dir}",
                    "data.data_split=[1,1,1]", "data.max_prompt_len=64", "data.max_response_len=6")
    manifest = prepare(p)
    train = pd.concat([pd.read_parquet(f"data/prepared/{f}.parquet") for f in ("sft", "pairs", "prompts")])
    held = pd.concat([pd.read_parquet(f"data/prepared/eval_{f}.parquet") for f in ("sft", "pairs", "prompts")])
    assert set(train["prompt"]).isdisjoint(held["prompt"])
    assert all(i.startswith("arith-train") for i in train["id"]) and all(i.startswith("arith-heldout")
                                                                         for i in held["id"])
    assert sum(v for k, v in manifest["counts"].items() if k.startswith("eval_")) == 60
    assert manifest["source"] == ["arithmetic"]


def test_arithmetic_without_a_model_is_an_error(workspace):
    from rlhf_core.data.readers import DataError
    from rlhf_core.stages.prepare import prepare
    from tests.conftest import make_params

    with pytest.raises(DataError, match="model.name_or_path"):
        prepare(make_params("data.source=arithmetic"))


def test_base_negatives_without_an_imported_model_is_an_error(workspace, tiny_chat_tokenizer_dir):
    """Sampling the base model's wrong answers needs a model: with only `model.tokenizer` the error names the key."""
    from rlhf_core.data.readers import DataError
    from rlhf_core.stages.prepare import prepare
    from tests.conftest import make_params

    p = make_params("data.source=arithmetic", "data.arithmetic.n_train=300", "data.arithmetic.n_held_out=60",
                    "data.arithmetic.base_negatives=4", f"model.tokenizer={tiny_chat_tokenizer_dir}",
                    "data.data_split=[1,1,1]", "data.max_prompt_len=64", "data.max_response_len=6")
    with pytest.raises(DataError, match="data.arithmetic.base_negatives"):
        prepare(p)


def test_base_negatives_reject_the_imported_models_own_wrong_answers(workspace, tiny_chat_tokenizer_dir):
    """A tiny random Llama imported from a local HF folder answers at random: the first pairs' rejected answers
    become its own samples where they are wrong, the rest of the pair files stay as generated."""
    import pandas as pd
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_core.stages.prepare import prepare
    from tests.conftest import make_params

    tok = AutoTokenizer.from_pretrained(tiny_chat_tokenizer_dir)
    model_dir = workspace / "tiny-model"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=256))
    with torch.no_grad():  # every input embeds alike, so the last hidden state is one vector c: "7" gets logit 10
        model.model.embed_tokens.weight[:] = model.model.embed_tokens.weight[0]
        c = model.model(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state[0, -1]
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.convert_tokens_to_ids("7")] = 10 * c / c.dot(c)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    base = ["data.source=arithmetic", "data.arithmetic.n_train=300", "data.arithmetic.n_held_out=60",
            "data.data_split=[1,1,1]", "data.max_prompt_len=64", "data.max_response_len=6",
            "data.arithmetic.base_max_new_tokens=4"]
    prepare(make_params(*base, "data.arithmetic.base_negatives=0", f"model.tokenizer={tiny_chat_tokenizer_dir}"))
    generated = {f: pd.read_parquet(f"data/prepared/{f}.parquet") for f in ("pairs", "eval_pairs")}
    manifest = prepare(make_params(*base, "data.arithmetic.base_negatives=8", f"model.name_or_path={model_dir}",
                                   f"model.tokenizer={tiny_chat_tokenizer_dir}"))
    counts = manifest["base_negatives"]
    assert counts["pairs"]["sampled"] == 8 and counts["eval_pairs"]["sampled"] >= 1
    for name, before in generated.items():
        after = pd.read_parquet(f"data/prepared/{name}.parquet")
        n = counts[name]["sampled"]
        assert len(after) == len(before) and after["chosen"].tolist() == before["chosen"].tolist()
        assert after["rejected"][n:].tolist() == before["rejected"][n:].tolist()  # beyond the sampled: as generated
        replaced = [a for a, b in zip(after["rejected"][:n], before["rejected"][:n], strict=True) if a != b]
        assert len(replaced) <= counts[name].get("base_wrong", 0)  # only where the base model erred
        assert counts[name]["base_wrong"] >= n - 1 and len(replaced) >= n - 2  # "7777" where it should not be
        assert all(set(r) == {"7"} for r in replaced)
        assert all(r != c for r, c in zip(after["rejected"], after["chosen"], strict=True))
