"""One rendering of the prompt for every phase (``model.chat_template``), over-long prompts dropped and counted,
ShareGPT and user-only chat rows, dropped rows named by file:line, per-phase errors naming their file.

The tokenizer is a user's own (``user_model_dir``: SmolLM2's, whose template injects a system prompt)."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf_core.config import ConfigError
from rlhf_core.data.readers import DataError
from rlhf_core.stages.prepare import prepare, summary
from tests.conftest import make_params, write_jsonl

QUESTIONS = [f"What is {a} plus {b}?" for a in range(6) for b in range(5)]  # 30 distinct prompts
SYSTEM, ASSISTANT = "<|im_start|>system", "<|im_start|>assistant\n"
NAMES = ("sft", "eval_sft", "pairs", "eval_pairs", "prompts", "eval_prompts")


def params(tokenizer: str, *overrides: str, sft="sft.jsonl", pairs="pairs.jsonl", prompts="prompts.jsonl"):
    files = {"sft": {"path": sft}, "pairs": {"path": pairs}, "prompts": {"path": prompts}}
    return make_params(*overrides, base={"data": {"source": "per_phase", "files": files},
                                         "model": {"tokenizer": tokenizer}})


def prompts_of(ws) -> dict[str, list[str]]:
    return {n: pd.read_parquet(ws / "data" / "prepared" / f"{n}.parquet").prompt.tolist() for n in NAMES}


@pytest.fixture
def files(workspace):
    """SFT as chat `messages`, pairs as plain pairwise rows, RL prompts as plain prompt rows."""
    write_jsonl(workspace / "sft.jsonl", [{"messages": [{"role": "user", "content": q},
                                                        {"role": "assistant", "content": "fine"}]}
                                          for q in QUESTIONS])
    write_jsonl(workspace / "pairs.jsonl", [{"prompt": q, "chosen": " good", "rejected": " bad"} for q in QUESTIONS])
    write_jsonl(workspace / "prompts.jsonl", [{"prompt": q, "answer": str(i)} for i, q in enumerate(QUESTIONS)])
    return workspace


def test_every_phase_prompt_carries_the_tokenizers_template(files, user_model_dir):
    manifest = prepare(params(user_model_dir))
    rendered = prompts_of(files)
    for name, prompts in rendered.items():
        assert prompts, name
        assert all(p.startswith(SYSTEM) and p.endswith(ASSISTANT) for p in prompts), (name, prompts[0])
    # the same question reads the same in every phase
    q = "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n" + ASSISTANT
    same = {p for prompts in rendered.values() for p in prompts if "What is 3 plus 4?" in p}
    assert len(same) == 1 and same.pop().endswith(q)
    assert manifest["chat_template"] == "auto" and manifest["dropped_total"] == 0


def test_chat_template_none_keeps_raw_text(files, user_model_dir):
    prepare(params(user_model_dir, "model.chat_template=none"))
    rendered = prompts_of(files)
    assert sorted(rendered["pairs"] + rendered["eval_pairs"]) == sorted(QUESTIONS)
    assert sorted(rendered["prompts"] + rendered["eval_prompts"]) == sorted(QUESTIONS)
    assert sorted(rendered["sft"] + rendered["eval_sft"]) == sorted(f"Human: {q}\n\nAssistant:" for q in QUESTIONS)


def test_a_users_jinja_file_renders_every_phase(files, user_model_dir):
    (files / "chat.jinja").write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
                                      "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    prepare(params(user_model_dir, "model.chat_template=chat.jinja"))
    expected = sorted(f"<<user>>{q}\n<<assistant>>" for q in QUESTIONS)
    rendered = prompts_of(files)
    for phase in ("sft", "pairs", "prompts"):
        assert sorted(rendered[phase] + rendered[f"eval_{phase}"]) == expected


def test_missing_template_file_and_missing_tokenizer_template_name_the_key(files, user_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.chat_template: no such template file nope\.jinja"):
        prepare(params(user_model_dir, "model.chat_template=nope.jinja"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(user_model_dir)
    tok.chat_template = None
    bare = tmp_path / "bare_tok"
    tok.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"model\.chat_template: tokenizer, but the tokenizer of .*bare_tok has "
                                          r"no chat template"):
        prepare(params(str(bare), "model.chat_template=tokenizer"))
    prepare(params(str(bare)))  # auto: raw text
    assert sorted(prompts_of(files)["prompts"] + prompts_of(files)["eval_prompts"]) == sorted(QUESTIONS)


def test_too_long_prompt_is_dropped_and_counted_in_the_summary(files, user_model_dir):
    long = "Please " * 60 + "what is 1 plus 1?"
    write_jsonl(files / "prompts.jsonl", [{"prompt": q} for q in QUESTIONS] + [{"prompt": long}])
    manifest = prepare(params(user_model_dir))
    assert manifest["dropped"] == {"prompts:prompt_too_long": 1}
    assert manifest["modified"] == {}
    assert manifest["counts"]["prompts"] + manifest["counts"]["eval_prompts"] == 30
    assert all(p.startswith(SYSTEM) for p in prompts_of(files)["prompts"])  # nothing cut into the template
    assert "dropped 1: prompts:prompt_too_long=1" in summary(manifest)
    with pytest.raises(ConfigError, match=r"data\.truncation: left"):
        prepare(params(user_model_dir, "data.truncation=left"))


def test_sharegpt_rows_and_user_only_rows(files, user_model_dir):
    write_jsonl(files / "sft.jsonl", [{"conversations": [{"from": "system", "value": "Be brief."},
                                                         {"from": "human", "value": q},
                                                         {"from": "gpt", "value": "fine"}]} for q in QUESTIONS])
    write_jsonl(files / "prompts.jsonl", [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS])
    manifest = prepare(params(user_model_dir))
    assert manifest["dropped_total"] == 0
    assert manifest["counts"]["sft"] + manifest["counts"]["eval_sft"] == 30
    assert manifest["counts"]["prompts"] + manifest["counts"]["eval_prompts"] == 30
    ws = files / "data" / "prepared"
    sft = pd.concat([pd.read_parquet(ws / "sft.parquet"), pd.read_parquet(ws / "eval_sft.parquet")])
    assert set(sft.response) == {"fine"}
    one = sft[sft.prompt.str.contains("What is 2 plus 1?", regex=False)].prompt.iloc[0]
    assert one == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 1?<|im_end|>\n"
                   + ASSISTANT)
    prompts = prompts_of(files)["prompts"]
    assert all(p.startswith(SYSTEM) and p.endswith(ASSISTANT) for p in prompts)


def test_dropped_chat_rows_are_named_by_file_and_line(files, user_model_dir):
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "fine"}]}
            for q in QUESTIONS]
    rows.insert(3, {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]})
    rows.append({"conversations": [{"from": "bot", "value": "hi"}, {"from": "gpt", "value": "x"}]})
    write_jsonl(files / "sft.jsonl", rows)
    manifest = prepare(params(user_model_dir))
    assert manifest["dropped"] == {"invalid_messages": 2}
    assert manifest["dropped_examples"] == ["sft.jsonl:4: invalid_messages", "sft.jsonl:32: invalid_messages"]


def test_per_phase_error_names_the_phase_and_its_file(files, user_model_dir):
    write_jsonl(files / "pairs.jsonl", [{"prompt": q, "chosen": " same", "rejected": " same"} for q in QUESTIONS])
    with pytest.raises(DataError, match=r"^phase 'pairs' \(pairs\.jsonl, data\.files\.pairs\) has 0 rows .*"
                                        r"dropped: chosen_equals_rejected=30$"):
        prepare(params(user_model_dir))
    write_jsonl(files / "pairs.jsonl", [{"prompt": q, "chosen": " good", "rejected": " bad"} for q in QUESTIONS])
    write_jsonl(files / "prompts.jsonl", [{"messages": [{"role": "assistant", "content": q}]} for q in QUESTIONS])
    with pytest.raises(DataError, match=r"^phase 'prompts' \(prompts\.jsonl, data\.files\.prompts\) has 0 rows "
                                        r".*dropped: invalid_messages=30$"):
        prepare(params(user_model_dir))
