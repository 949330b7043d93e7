"""``rlhf stage prepare``: raw data -> ``data/prepared/*.parquet`` + manifest, and ``models/base``.

Steps: read sources -> get or train the tokenizer -> normalise to the
canonical schema, every prompt rendered alike (``model.chat_template``:
``prompt_rendering``) -> split into phases (``data_split``) -> project each
phase to its columns -> length-filter (drop over-long prompts, or left-truncate
raw text: ``truncation``) -> de-duplicate -> hold out eval rows -> write
atomically.  Every dropped row is counted by reason in ``manifest.json`` (the
first ones named by ``file:line``) and in the stage's ``summary``; an empty
phase is an error naming its file and key.

With ``model.name_or_path`` the base model is imported into ``models/base`` as a plain HF folder
(``models.importing``: GGUF, package, local folder or Hub id), beside its tokenizer. ``data.source:
arithmetic`` generates its own held-out rows (new operand pairs and phrasings) instead of a random split, and
its preference pairs reject the imported base model's own wrong answers (``data.base_negatives``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from itertools import chain, groupby
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_core.config import Params, SourceConfig
from rlhf_core.data.base_negatives import replace_with_base_errors
from rlhf_core.data.normalize import Rendering, normalize_rows
from rlhf_core.data.phases import (
    CANON_COLUMNS,
    PHASE_COLUMNS,
    Deduper,
    Lengths,
    RowFile,
    batched,
    length_filter,
    project,
)
from rlhf_core.data.readers import DataError, iter_file, iter_hf
from rlhf_core.data.rendering import prompt_rendering, truncation
from rlhf_core.data.split import split_by_shares, train_eval_split
from rlhf_core.data.tokenizer import (
    chat_renderer,
    load_tokenizer,
    source_tokenizer_path,
    tiny_model_config,
    train_demo_tokenizer,
)
from rlhf_core.models.importing import import_base_model
from rlhf_core.ops import paths
from rlhf_core.ops.atomic import write_json_atomic
from rlhf_core.ops.input_links import sync_input_links
from rlhf_core.ops.integrity import seal_model_dir
from rlhf_core.ops.meta import build_meta, file_sha256, write_meta
from rlhf_core.rewards import arithmetic, demo_task, multistep

# One pass over a raw source: (origin, record, format, source name); structural drops counted in the Counter given.
Stream = Callable[[Counter], Iterator[tuple[str, dict, str, str]]]


def _source_name(src: SourceConfig) -> str:
    return src.path or f"hf:{src.hf_id}[{src.hf_split}]"


def _source_stream(sources: list[SourceConfig], drop: bool) -> Stream:
    def stream(dropped: Counter):
        for src in sources:
            rows = (iter_file(src.path, drop=drop, dropped=dropped) if src.path is not None
                    else iter_hf(src.hf_id, src.hf_split, src.hf_config))
            yield from ((o, r, src.format, _source_name(src)) for o, r in rows)
    return stream


def _rows_stream(rows: list[dict], source: str) -> Stream:
    return lambda _dropped: ((r["id"], r, "prompt_response", source) for r in rows)


def _texts(rows: Iterator[tuple[str, dict, str, str]]):
    """Every string in the raw rows (for training the demo tokenizer)."""
    for _, record, _, _ in rows:
        for value in record.values():
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (m["content"] for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))


def load_raw(params: Params, tok=None) -> dict[str, Stream]:
    """The raw rows, as streams keyed by ``mixed`` (and ``held_out`` for the arithmetic and multi-step tasks) or
    by phase. The tasks render their prompts with ``tok``'s chat template (multi-step without a model: the demo's
    ``Human: ... Assistant:``)."""
    data = params.data
    drop = data.on_malformed == "drop"
    if data.source == "arithmetic":
        a = data.arithmetic
        render = chat_renderer(tok)
        if render is None:
            raise DataError("data.source: arithmetic renders questions with the model's chat template, but the "
                            f"tokenizer of {source_tokenizer_path(params.model)} has none")
        train, held = arithmetic.generate(a.n_train, a.n_held_out, a.max_operand, list(a.ops), params.project.seed,
                                          a.held_out_pair_share, a.held_out_phrasings, render, a.answer_style)
        return {"mixed": _rows_stream(train, "arithmetic"), "held_out": _rows_stream(held, "arithmetic")}
    if data.source == "multistep":
        m = data.multistep
        render = chat_renderer(tok) if tok is not None else lambda messages: demo_task.render_prompt(
            messages[-1]["content"])  # the tiny model's tokenizer is trained on these rows, after them
        if render is None:
            raise DataError("data.source: multistep renders questions with the model's chat template, but the "
                            f"tokenizer of {source_tokenizer_path(params.model)} has none")
        train, held = multistep.generate(m.n_train, m.n_held_out, (m.min_ops, m.max_ops), m.max_operand,
                                         params.project.seed, m.held_out_share, m.held_out_phrasings, render)
        return {"mixed": _rows_stream(train, "multistep"), "held_out": _rows_stream(held, "multistep")}
    if data.source == "demo":
        d = data.demo
        rows = demo_task.generate(d.n_rows, d.max_operand, list(d.ops), d.wrong_share, params.project.seed,
                                  d.slip_share)
        return {"mixed": _rows_stream(rows, "demo")}
    if data.source == "mixed":
        if not data.sources:
            raise DataError("data.sources: `source: mixed` needs at least one source")
        return {"mixed": _source_stream(data.sources, drop)}
    out = {}
    for phase in paths.PHASES:
        src = getattr(data.files, phase)
        if src is None:
            raise DataError(f"data.files.{phase}: `source: per_phase` needs a source for every phase")
        out[phase] = _source_stream([src], drop)
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


def build_tokenizer(params: Params, raw: dict[str, Stream]) -> Any:
    """The demo tokenizer, trained on every string of the raw rows (one extra pass; its drops are not counted)."""
    corpus = chain((t for stream in raw.values() for t in _texts(stream(Counter()))), ["Human: Assistant:"])
    return train_demo_tokenizer(corpus, params.model.tiny.vocab_size)


def _base_negatives(params: Params, model, tok, prepared: Path) -> dict:
    """The arithmetic pairs' rejected answers from the imported base model's own samples
    (``data.base_negatives`` training pairs, and the same share of the held-out pairs), rewritten into
    ``prepared``'s pair files (the task's data is small); returns the counts."""
    a = params.data.arithmetic
    if model is None:
        raise DataError(f"data.arithmetic.base_negatives: {a.base_negatives} pairs sample the base model, but "
                        "model.name_or_path is null (no model is imported); set it or base_negatives: 0")
    files = {name: RowFile(prepared / f"{name}.parquet", PHASE_COLUMNS["pairs"]) for name in ("pairs", "eval_pairs")}
    rows = {name: f.read() for name, f in files.items()}
    n_eval = round(len(rows["eval_pairs"]) * min(1.0, a.base_negatives / max(1, len(rows["pairs"]))))
    out = {}
    for name, n in (("pairs", a.base_negatives), ("eval_pairs", n_eval)):
        out[name] = dict(replace_with_base_errors(model, tok, rows[name][:n], a.base_max_new_tokens,
                                                  params.project.seed, arithmetic.final_number,
                                                  arithmetic.with_final_number))
        rewritten = RowFile(files[name].path, files[name].columns)
        rewritten.write(rows[name])
        rewritten.close()
    return out


def summary(manifest: dict) -> str:
    """The stage's one-line account: rows per file, the rendering, what was dropped and cut, by reason."""
    parts = [json.dumps(manifest["counts"]), f"chat template: {manifest['chat_template']}"
             f" ({'rendered' if manifest['templated'] else 'raw text'})"]
    for key, what in (("dropped", "dropped"), ("modified", "modified")):
        if manifest[key]:
            reasons = ", ".join(f"{r}={n}" for r, n in manifest[key].items())
            parts.append(f"{what} {sum(manifest[key].values())}: {reasons}")
    return "; ".join(parts)


def _source_names(params: Params) -> str | list[str]:
    data = params.data
    if data.source in ("demo", "arithmetic", "multistep"):
        return data.source if data.source == "demo" else [data.source]
    sources = data.sources if data.source == "mixed" else [getattr(data.files, ph) for ph in paths.PHASES]
    return sorted({_source_name(src) for src in sources})


def _build_phases(params: Params, raw: dict[str, Stream], tok, rendering: Rendering, work: Path, out: Path,
                  dropped: Counter, modified: Counter, examples: list[str]) -> tuple[dict[str, int], dict]:
    """The raw streams -> ``out/{phase,eval_phase}.parquet`` through files in ``work``, a batch at a time
    (``rlhf_core.data.phases``); returns the row counts and the token statistics.

    Pass 1 normalises each stream into a canonical row file; the phases are then cut by ``data_split`` over the
    row count (the same permutation as holding every row in memory), pass 2 filters each phase's rows, and
    pass 3 splits each phase into train and eval (or takes the task's own held-out rows as eval).
    """
    data, seed = params.data, params.project.seed
    cut = truncation(params, rendering)
    by_source: dict[str, Counter] = {}  # per_phase: each phase's own drops, for its error

    def canon(key: str) -> RowFile:
        rows = RowFile(work / f"canon-{key}.parquet", CANON_COLUMNS)
        counter = by_source.setdefault(key, Counter())
        for batch in batched(raw[key](counter)):
            for (fmt, src), group in groupby(batch, key=lambda row: (row[2], row[3])):
                rows.write(normalize_rows([(o, r) for o, r, _, _ in group], fmt, data.columns, rendering, counter,
                                          src, examples))
        return rows.close()

    def phases_of(rows: RowFile, phase: str | None) -> np.ndarray:
        """Each canonical row's phase index: cut by ``data_split``, or all ``phase``."""
        if phase is not None:
            return np.full(rows.count, paths.PHASES.index(phase), dtype=np.int8)
        phase_of = np.empty(rows.count, dtype=np.int8)
        for k, idx in enumerate(split_by_shares(rows.count, data.data_split, seed)):
            phase_of[idx] = k
        return phase_of

    def filtered(rows: RowFile, phase_of: np.ndarray, key: str) -> dict[str, tuple[RowFile, Lengths]]:
        """``key``'s rows, by phase (a per_phase source's own phase only, even with no rows left)."""
        wanted = ([key] if key in paths.PHASES else
                  [ph for k, ph in enumerate(paths.PHASES) if (phase_of == k).any() or phase_of.size == 0])
        files = {ph: RowFile(work / f"{key}-{ph}.parquet", PHASE_COLUMNS[ph]) for ph in wanted}
        lengths = {ph: Lengths() for ph in wanted}
        dedupe = {ph: Deduper(ph) for ph in wanted}
        offset, counter = 0, by_source[key]
        for batch in rows.batches():
            where, offset = phase_of[offset:offset + len(batch)], offset + len(batch)
            for ph in wanted:
                k = paths.PHASES.index(ph)
                kept = project([row for row, p in zip(batch, where, strict=True) if p == k], ph, counter)
                kept, lens = length_filter(kept, ph, tok, data.max_prompt_len, data.max_response_len, cut, counter,
                                           modified)
                lengths[ph].add(lens)
                files[ph].write(dedupe[ph](kept, counter) if data.dedupe else kept)
        return {ph: (files[ph].close(), lengths[ph]) for ph in wanted}

    def checked(rows: RowFile | None, phase: str, need: int) -> RowFile:
        count = rows.count if rows is not None else 0
        if count < need:
            src = getattr(data.files, phase) if data.source == "per_phase" else None
            counter = by_source[phase] if src is not None else dropped
            where = f" ({_source_name(src)}, data.files.{phase})" if src is not None else ""
            reasons = ", ".join(f"{r}={n}" for r, n in sorted(counter.items())) or "none"
            raise DataError(f"phase {phase!r}{where} has {count} rows after filtering (need >= {need} for train + "
                            f"eval); dropped: {reasons}")
        return rows

    by_phase: dict[str, tuple[RowFile, Lengths]] = {}
    if "mixed" in raw:
        rows = canon("mixed")
        by_phase = filtered(rows, phases_of(rows, None), "mixed")
    else:
        for ph in paths.PHASES:
            rows = canon(ph)
            by_phase |= filtered(rows, phases_of(rows, ph), ph)
    held_out = None
    if "held_out" in raw:
        rows = canon("held_out")
        held_out = filtered(rows, phases_of(rows, None), "held_out")
    for counter in by_source.values():
        dropped.update(counter)

    counts, token_stats = {}, {}
    for k, phase in enumerate(paths.PHASES):
        rows, lengths = by_phase.get(phase, (None, Lengths()))
        rows = checked(rows, phase, 2 if held_out is None else 1)
        token_stats[phase] = lengths.stats()
        train, evals = RowFile(out / f"{phase}.parquet", PHASE_COLUMNS[phase]), \
            RowFile(out / f"eval_{phase}.parquet", PHASE_COLUMNS[phase])
        if held_out is None:
            is_eval = np.zeros(rows.count, dtype=bool)
            is_eval[train_eval_split(rows.count, data.eval_fraction, seed + 1 + k)[1]] = True
            offset = 0
            for batch in rows.batches():
                flags, offset = is_eval[offset:offset + len(batch)], offset + len(batch)
                train.write([row for row, e in zip(batch, flags, strict=True) if not e])
                evals.write([row for row, e in zip(batch, flags, strict=True) if e])
        else:  # the task's own held-out questions
            for batch in rows.batches():
                train.write(batch)
            for batch in checked(held_out.get(phase, (None,))[0], phase, 1).batches():
                evals.write(batch)
        counts[phase], counts[f"eval_{phase}"] = train.close().count, evals.close().count
    return counts, token_stats


def prepare(params: Params, root: str | Path = ".") -> dict:
    """Run the prepare stage under ``root``; returns the manifest. Rows stream from the sources to the prepared
    Parquet files in bounded memory (``_build_phases``)."""
    root = Path(root)
    sync_input_links(params, root)  # DVC's view of the files params.yaml names (ops.input_links)
    dropped: Counter = Counter()
    modified: Counter = Counter()
    tok = source_tokenizer(params)
    raw = load_raw(params, tok)
    tok = tok if tok is not None else build_tokenizer(params, raw)
    rendering = prompt_rendering(params, tok, root)
    examples: list[str] = []
    prepared, base = root / paths.PREPARED, root / paths.BASE_MODEL
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".prepare-"))
    try:
        (tmp / "prepared").mkdir()
        (tmp / "work").mkdir()
        counts, token_stats = _build_phases(params, raw, tok, rendering, tmp / "work", tmp / "prepared", dropped,
                                            modified, examples)
        shutil.rmtree(tmp / "work")
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
            negatives = _base_negatives(params, base_model, tok, tmp / "prepared")
        hashes = {f"{name}.parquet": file_sha256(tmp / "prepared" / f"{name}.parquet") for name in counts}
        params_hash = params.section_hash("project", "data", "model")
        manifest = {
            "source": _source_names(params),
            "params_hash": params_hash,
            "counts": counts,
            "dropped": dict(sorted(dropped.items())),
            "dropped_total": sum(dropped.values()),
            "dropped_examples": examples,
            "chat_template": rendering.name,
            "templated": rendering.templated,
            "truncation": truncation(params, rendering),
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
