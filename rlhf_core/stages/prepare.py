"""``rlhf stage prepare``: raw data -> ``data/prepared/*.parquet`` + manifest, and ``models/base``.

Steps: read sources -> get or train the tokenizer -> normalise to the
canonical schema -> split into phases (``data_split``) -> project each phase
to its columns -> length-filter (left-truncate or drop over-long prompts) ->
de-duplicate -> hold out eval rows -> write atomically.  Every dropped row is
counted by reason in ``manifest.json``; an empty phase is an error.

With ``model.name_or_path`` the base model is imported into ``models/base`` as a plain HF folder
(``models.importing``: GGUF, package, local folder or Hub id), beside its tokenizer. ``data.source:
arithmetic`` generates its own held-out rows (new operand pairs and phrasings) instead of a random split, and
its preference pairs reject the imported base model's own wrong answers (``data.base_negatives``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_core import paths
from rlhf_core.atomic import write_json_atomic
from rlhf_core.config import ColumnMap, Params, SourceConfig
from rlhf_core.data.normalize import normalize_rows
from rlhf_core.data.readers import DataError, read_file, read_hf
from rlhf_core.data.split import split_by_shares, train_eval_split
from rlhf_core.data.tokenizer import (
    chat_renderer,
    load_tokenizer,
    source_tokenizer_path,
    tiny_model_config,
    train_demo_tokenizer,
)
from rlhf_core.integrity import seal_model_dir
from rlhf_core.meta import build_meta, file_sha256, write_meta
from rlhf_core.models.importing import import_base_model
from rlhf_core.rewards import arithmetic, demo_task

PHASE_COLUMNS = {
    "sft": ("id", "prompt", "response", "answer", "source"),
    "pairs": ("id", "prompt", "chosen", "rejected", "answer", "source"),
    "prompts": ("id", "prompt", "answer", "source"),
}
RESPONSE_FIELDS = {"sft": ("response",), "pairs": ("chosen", "rejected"), "prompts": ()}


def _source_name(src: SourceConfig) -> str:
    return src.path or f"hf:{src.hf_id}[{src.hf_split}]"


def _read_source(src: SourceConfig, drop: bool, dropped: Counter) -> list[tuple[str, dict]]:
    if src.path is not None:
        return read_file(src.path, drop=drop, dropped=dropped)
    return read_hf(src.hf_id, src.hf_split, src.hf_config)


def _texts(rows: list[tuple[str, dict]]):
    """Every string in the raw rows (for training the demo tokenizer)."""
    for _, record in rows:
        for value in record.values():
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (m["content"] for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))


def _project(rows: list[dict], phase: str, dropped: Counter) -> list[dict]:
    """Keep the rows that can serve ``phase`` and map them to its columns."""
    out = []
    for row in rows:
        row = dict(row)
        if phase == "sft":
            row["response"] = row["response"] if row["response"] is not None else row["chosen"]
            if row["response"] is None:
                dropped["sft:no_response"] += 1
                continue
        elif phase == "pairs" and (row["chosen"] is None or row["rejected"] is None):
            dropped["pairs:no_pair"] += 1
            continue
        out.append({k: row.get(k) for k in PHASE_COLUMNS[phase]})
    return out


def _length_filter(rows: list[dict], phase: str, tok, params: Params, dropped: Counter,
                   modified: Counter) -> tuple[list[dict], dict[str, list[int]]]:
    """Left-truncate (or drop) over-long prompts; drop over-long responses. Returns rows and token lengths."""
    data = params.data
    if not rows:
        return rows, {}
    enc = tok([r["prompt"] for r in rows], add_special_tokens=False, return_offsets_mapping=True)
    resp_lens = {f: [len(ids) for ids in tok([r[f] for r in rows], add_special_tokens=False)["input_ids"]]
                 for f in RESPONSE_FIELDS[phase]}
    kept, lengths = [], {"prompt": [], **{f: [] for f in resp_lens}}
    for i, row in enumerate(rows):
        n_prompt = len(enc["input_ids"][i])
        if any(resp_lens[f][i] > data.max_response_len for f in resp_lens):
            dropped[f"{phase}:response_too_long"] += 1
            continue
        if any(resp_lens[f][i] == 0 for f in resp_lens):
            dropped[f"{phase}:empty_field"] += 1
            continue
        if n_prompt > data.max_prompt_len:
            if data.truncation == "drop":
                dropped[f"{phase}:prompt_too_long"] += 1
                continue
            start_char = enc["offset_mapping"][i][n_prompt - data.max_prompt_len][0]
            row = {**row, "prompt": row["prompt"][start_char:]}
            modified[f"{phase}:prompt_truncated_left"] += 1
            n_prompt = data.max_prompt_len
        kept.append(row)
        lengths["prompt"].append(n_prompt)
        for f in resp_lens:
            lengths[f].append(resp_lens[f][i])
    return kept, lengths


def _dedupe(rows: list[dict], phase: str, dropped: Counter) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        key = tuple(row[k] for k in PHASE_COLUMNS[phase] if k not in ("id", "source"))
        if key in seen:
            dropped[f"{phase}:duplicate"] += 1
            continue
        seen.add(key)
        out.append(row)
    return out


def _stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {"mean": round(float(arr.mean()), 2), "p50": float(np.percentile(arr, 50)),
            "p95": float(np.percentile(arr, 95)), "max": int(arr.max())}


def _write_parquet(rows: list[dict], columns: tuple[str, ...], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(c, pa.string()) for c in columns])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def load_raw(params: Params, dropped: Counter, tok=None) -> dict[str, list[tuple[str, dict, str, str]]]:
    """Raw rows keyed by ``mixed`` (and ``held_out`` for the arithmetic task) or by phase: (origin, record, format,
    source name). The arithmetic task renders its prompts with ``tok``'s chat template."""
    data = params.data
    drop = data.on_malformed == "drop"
    if data.source == "arithmetic":
        a = data.arithmetic
        render = chat_renderer(tok)
        if render is None:
            raise DataError("data.source: arithmetic renders questions with the model's chat template, but the "
                            f"tokenizer of {source_tokenizer_path(params.model)} has none")
        train, held = arithmetic.generate(a.n_train, a.n_held_out, a.max_operand, list(a.ops), params.project.seed,
                                          a.held_out_pair_share, a.held_out_phrasings, render)
        return {"mixed": [(r["id"], r, "prompt_response", "arithmetic") for r in train],
                "held_out": [(r["id"], r, "prompt_response", "arithmetic") for r in held]}
    if data.source == "demo":
        d = data.demo
        rows = demo_task.generate(d.n_rows, d.max_operand, list(d.ops), d.wrong_share, params.project.seed,
                                  d.slip_share)
        return {"mixed": [(r["id"], r, "prompt_response", "demo") for r in rows]}
    if data.source == "mixed":
        if not data.sources:
            raise DataError("data.sources: `source: mixed` needs at least one source")
        return {"mixed": [(o, r, s.format, _source_name(s)) for s in data.sources
                          for o, r in _read_source(s, drop, dropped)]}
    out = {}
    for phase in paths.PHASES:
        src = getattr(data.files, phase)
        if src is None:
            raise DataError(f"data.files.{phase}: `source: per_phase` needs a source for every phase")
        out[phase] = [(o, r, src.format, _source_name(src)) for o, r in _read_source(src, drop, dropped)]
    return out


def source_tokenizer(params: Params) -> Any:
    """The model's own tokenizer (``model.tokenizer`` or ``model.name_or_path``), or None for the demo's."""
    src = source_tokenizer_path(params.model)
    if src is None:
        if params.data.source == "arithmetic":
            raise DataError("data.source: arithmetic needs a pretrained chat model (model.name_or_path) and its "
                            "tokenizer")
        return None
    return load_tokenizer(src, params.model.trust_remote_code)


def build_tokenizer(params: Params, raw: dict[str, list]) -> Any:
    corpus = [t for rows in raw.values() for t in _texts([(o, r) for o, r, _, _ in rows])]
    corpus += ["Human: Assistant:"]
    return train_demo_tokenizer(corpus, params.model.tiny.vocab_size)


def _base_negatives(params: Params, model, tok, train: list[dict], evals: list[dict]) -> dict:
    """The arithmetic pairs' rejected answers from the imported base model's own samples
    (``data.base_negatives`` training pairs, and the same share of the held-out pairs); returns the counts."""
    from rlhf_core.data.base_negatives import replace_with_base_errors

    a = params.data.arithmetic
    if model is None:
        raise DataError(f"data.arithmetic.base_negatives: {a.base_negatives} pairs sample the base model, but "
                        "model.name_or_path is null (no model is imported); set it or base_negatives: 0")
    n_eval = round(len(evals) * min(1.0, a.base_negatives / max(1, len(train))))
    out = {}
    for name, rows in (("pairs", train[:a.base_negatives]), ("eval_pairs", evals[:n_eval])):
        out[name] = dict(replace_with_base_errors(model, tok, rows, a.base_max_new_tokens, params.project.seed,
                                                  arithmetic.final_number, arithmetic.render_answer))
    return out


def prepare(params: Params, root: str | Path = ".") -> dict:
    """Run the prepare stage under ``root``; returns the manifest."""
    root = Path(root)
    dropped: Counter = Counter()
    modified: Counter = Counter()
    tok = source_tokenizer(params)
    raw = load_raw(params, dropped, tok)
    tok = tok if tok is not None else build_tokenizer(params, raw)
    render = chat_renderer(tok)
    cols: ColumnMap = params.data.columns
    seed = params.project.seed

    def canon(rows):
        out = []
        for fmt, src in dict.fromkeys((f, s) for _, _, f, s in rows):
            subset = [(o, r) for o, r, f, s in rows if (f, s) == (fmt, src)]
            out += normalize_rows(subset, fmt, cols, render, dropped, src)
        return out

    def by_shares(rows):
        parts = split_by_shares(len(rows), params.data.data_split, seed)
        return {ph: [rows[i] for i in idx] for ph, idx in zip(paths.PHASES, parts, strict=True)}

    def filtered(rows, phase, need):
        rows = _project(rows, phase, dropped)
        rows, lengths = _length_filter(rows, phase, tok, params, dropped, modified)
        if params.data.dedupe:
            rows = _dedupe(rows, phase, dropped)
        if len(rows) < need:
            reasons = ", ".join(f"{r}={n}" for r, n in sorted(dropped.items())) or "none"
            raise DataError(f"phase {phase!r} has {len(rows)} rows after filtering (need >= {need} for train + "
                            f"eval); dropped: {reasons}")
        return rows, lengths

    by_phase = by_shares(canon(raw["mixed"])) if "mixed" in raw else {ph: canon(raw[ph]) for ph in paths.PHASES}
    held_out = by_shares(canon(raw["held_out"])) if "held_out" in raw else None

    outputs, counts, token_stats = {}, {}, {}
    for k, phase in enumerate(paths.PHASES):
        rows, lengths = filtered(by_phase[phase], phase, 2 if held_out is None else 1)
        if held_out is None:
            train_idx, eval_idx = train_eval_split(len(rows), params.data.eval_fraction, seed + 1 + k)
            outputs[phase] = [rows[i] for i in train_idx]
            outputs[f"eval_{phase}"] = [rows[i] for i in eval_idx]
        else:  # the task's own held-out questions
            outputs[phase] = rows
            outputs[f"eval_{phase}"] = filtered(held_out[phase], phase, 1)[0]
        token_stats[phase] = {f: _stats(v) for f, v in lengths.items()}

    prepared, base = root / paths.PREPARED, root / paths.BASE_MODEL
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".prepare-"))
    try:
        (tmp / "prepared").mkdir()
        tok.save_pretrained(tmp / "base")
        base_meta: dict[str, Any] = {"tokenizer_source": source_tokenizer_path(params.model) or "trained:demo"}
        base_model = None
        if params.model.name_or_path is None:
            config = tiny_model_config(tok, params.model.tiny)
            config.save_pretrained(tmp / "base")
            base_meta["model"] = "tiny-llama (initialised by later stages from config.json)"
        else:
            base_model, info = import_base_model(params.model.name_or_path, tmp / "base", tok,
                                                 params.model.trust_remote_code)
            base_meta |= info
        negatives = None
        if params.data.source == "arithmetic" and params.data.arithmetic.base_negatives:
            negatives = _base_negatives(params, base_model, tok, outputs["pairs"], outputs["eval_pairs"])
        hashes = {}
        for name, rows in outputs.items():
            phase = name.removeprefix("eval_")
            fname = f"{name}.parquet"
            _write_parquet(rows, PHASE_COLUMNS[phase], tmp / "prepared" / fname)
            hashes[fname] = file_sha256(tmp / "prepared" / fname)
            counts[name] = len(rows)
        params_hash = params.section_hash("project", "data", "model")
        manifest = {
            "source": params.data.source if params.data.source == "demo" else
            sorted({s for rows in raw.values() for *_, s in rows}),
            "params_hash": params_hash,
            "counts": counts,
            "dropped": dict(sorted(dropped.items())),
            "dropped_total": sum(dropped.values()),
            "modified": dict(sorted(modified.items())),
            "hashes": hashes,
            "token_stats": token_stats,
            **({"base_negatives": negatives} if negatives is not None else {}),
            "tokenizer": {"vocab_size": len(tok), "pad_token": tok.pad_token, "eos_token": tok.eos_token,
                          "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id},
        }
        write_json_atomic(tmp / "prepared" / "manifest.json", manifest)
        write_meta(tmp / "prepared", build_meta("prepare", params_hash))
        write_meta(tmp / "base", build_meta("prepare", params_hash, **base_meta))
        seal_model_dir(tmp / "base")  # the tokenizer every stage loads: checked like any model
        for src_dir, dst in ((tmp / "prepared", prepared), (tmp / "base", base)):
            dst.parent.mkdir(parents=True, exist_ok=True)
            old = dst.with_name(f".{dst.name}.old")
            if dst.exists():
                dst.rename(old)
            src_dir.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    metrics = {"counts": counts, "dropped_total": manifest["dropped_total"], "vocab_size": len(tok)}
    write_json_atomic(root / paths.METRICS / "prepare.json", metrics)
    return manifest


def run(params: Params, root: str | Path = ".", log=None) -> dict:
    """Stage entry point used by the CLI."""
    manifest = prepare(params, root)
    if log is not None:
        log({f"rows_{k}": v for k, v in manifest["counts"].items()} | {"dropped_total": manifest["dropped_total"]}, 0)
    return manifest
