"""Corrupted files are detected, named, and never trained from.

Checkpoints: a real SFT run on the tiny demo saves checkpoints with manifests; a bit flip, a truncation or a
`latest` naming a missing step makes the resume fall back to the newest checkpoint that checks out (ending with
the uninterrupted run's weights), or refuse. Prepared data: a parquet file altered after prepare, or not parquet
at all, stops the stage naming it. Model directories: one damaged after its stage wrote it (a flipped bit, a
truncated or missing file) is refused at load, naming the file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhf_core.engine.checkpoint import MANIFEST, CorruptCheckpointError, verify_checkpoint
from tests.rlhf_core.trainers.test_sft import prepared, tiny_params, ws  # noqa: F401  (the tiny demo's prepared workspace)

STEPS = ["sft.max_steps=4", "sft.save_every=2", "sft.keep_checkpoints=2", "eval.max_prompts=8"]


def _weights(root):
    from safetensors.torch import load_file

    return load_file(root / "models/sft/model.safetensors")


def _run(root, *extra):
    from rlhf_core.trainers.sft import train_sft

    return train_sft(tiny_params(*STEPS, *extra), root)


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_good_one(ws, tmp_path, capfd):  # noqa: F811
    first = _run(ws)
    reference = _weights(ws)
    ckpts = ws / "checkpoints/sft"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert verify_checkpoint(ckpts / "step_00000004") is None
    assert json.loads((ckpts / "step_00000004" / MANIFEST).read_text())["files"]
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpts, pristine)

    # one flipped bit in the newest model states: detected, named, resumed from step 2 instead
    model_file = next((ckpts / "step_00000004").rglob("*model_states.pt"))
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    model_file.write_bytes(bytes(data))
    problem = verify_checkpoint(ckpts / "step_00000004")
    assert problem == f"{model_file}: sha256 differs from the manifest (corrupted)"
    again = _run(ws)
    assert again["resumed_from_step"] == 2 and again["steps"] == first["steps"] == 4
    assert f"resuming from {ckpts / 'step_00000002'} instead: {problem}" in capfd.readouterr().err
    for k, v in _weights(ws).items():  # retrained steps 3-4 from step 2: the uninterrupted run's weights
        assert torch.equal(v, reference[k]), k

    # `latest` naming a step that is gone: the newest one that checks out
    shutil.rmtree(ckpts)
    shutil.copytree(pristine, ckpts)
    shutil.rmtree(ckpts / "step_00000004")
    assert _run(ws)["resumed_from_step"] == 2


def test_no_checkpoint_that_checks_out_refuses_naming_the_files(ws):  # noqa: F811
    _run(ws, "sft.keep_checkpoints=1")
    ckpts = ws / "checkpoints/sft"
    (only,) = ckpts.glob("step_*")
    rng = only / "rng_rank0.pt"
    rng.write_bytes(rng.read_bytes()[:10])  # truncated (a full disk, a half-copied volume)
    with pytest.raises(CorruptCheckpointError, match=rf"no usable checkpoint in {ckpts}: {rng}: 10 bytes, the "
                                                     r"manifest says \d+ \(truncated or altered\)\. Refusing"):
        _run(ws, "sft.keep_checkpoints=1")
    assert rng.exists()  # nothing deleted: the operator decides


def test_a_corrupted_prepared_file_stops_the_stage_naming_it(ws):  # noqa: F811
    from rlhf_core.data.readers import DataError
    from rlhf_core.trainers.sft import train_sft

    (ws / "data/prepared/sft.parquet").write_text("id,prompt\n1,hello\n")
    with pytest.raises(DataError, match=r"data/prepared/sft.parquet: not a readable parquet file \(.*"
                                        r"`rm data/prepared/sft.parquet && dvc checkout data/prepared` \(`rlhf cache "
                                        r"verify` checks DVC's cache\) or re-run `rlhf stage prepare`"):
        train_sft(tiny_params(*STEPS), ws)


def test_a_bit_flip_in_a_prepared_file_that_still_parses_stops_the_stage(ws):  # noqa: F811
    import io
    import re

    import pyarrow.parquet as pq

    from rlhf_core.data.readers import DataError
    from rlhf_core.trainers.sft import train_sft

    path = ws / "data/prepared/sft.parquet"
    pristine = path.read_bytes()
    table = pq.read_table(path)
    for m in re.finditer(rb"What is (\d)", pristine):  # one bit of a digit in a prompt: '3' -> '2', '8' -> '9'
        flipped = bytearray(pristine)
        flipped[m.start(1)] ^= 0x01
        try:
            altered = pq.read_table(io.BytesIO(bytes(flipped)))
        except OSError:
            continue
        if not altered.equals(table):
            break
    else:
        pytest.fail("no single-bit flip of sft.parquet that still parses to other rows")
    path.write_bytes(bytes(flipped))
    assert pq.read_table(path).num_rows == table.num_rows  # parquet alone would train on it
    with pytest.raises(DataError, match=r"data/prepared/sft.parquet: sha256 differs from the one "
                                        r"data/prepared/manifest.json recorded when prepare wrote it \(corrupted or "
                                        r"edited since.*dvc checkout data/prepared`.* or re-run `rlhf stage prepare`"):
        train_sft(tiny_params(*STEPS), ws)
    assert not (ws / "checkpoints/sft").exists()
    path.write_bytes(pristine)
    assert _run(ws, "sft.save_every=0")["steps"] == 4  # restored: trains


def test_a_damaged_model_directory_is_refused_at_load_naming_the_file(ws):  # noqa: F811
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.ops.integrity import MODEL_MANIFEST, CorruptModelError

    _run(ws, "sft.save_every=0")
    sft = ws / "models/sft"
    files = json.loads((sft / MODEL_MANIFEST).read_text())["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "rlhf_meta.json", "README.md"} <= set(files)
    load_causal_lm(sft)  # as written: loads

    weights = sft / "model.safetensors"
    pristine = weights.read_bytes()
    data = bytearray(pristine)
    data[-100] ^= 0x01  # a flipped bit inside a tensor: safetensors itself would load it
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match=rf"{weights}: sha256 differs from the manifest \(corrupted\); the "
                                                rf"model in {sft} is damaged and was not loaded: restore it "
                                                rf"\(`rm -r {sft} && dvc checkout {sft}`; `rlhf cache verify` checks "
                                                r"DVC's cache\) or re-run the stage that wrote it"):
        load_causal_lm(sft)
    weights.write_bytes(pristine[:1000])  # truncated (an interrupted copy)
    with pytest.raises(CorruptModelError, match=rf"{weights}: 1000 bytes, the manifest says {len(pristine)}"):
        load_causal_lm(sft)
    weights.write_bytes(pristine)
    (sft / "tokenizer.json").unlink()  # a file lost
    with pytest.raises(CorruptModelError, match=rf"{sft / 'tokenizer.json'}: missing"):
        load_causal_lm(sft)
    # the next stage refuses it the same way, before training (the CLI maps this to exit 65)
    from rlhf_core.trainers.rm import train_rm

    with pytest.raises(CorruptModelError, match=r"tokenizer.json: missing"):
        train_rm(tiny_params("rm.max_steps=2"), ws)

    # the tokenizer every stage loads (models/base, written by prepare) is sealed and checked the same way
    base_tok = ws / "models/base/tokenizer.json"
    assert (base_tok.parent / MODEL_MANIFEST).exists()
    base_tok.write_text(base_tok.read_text().replace('"<pad>"', '"<pbd>"', 1))  # same size, one token renamed
    with pytest.raises(CorruptModelError, match=rf"{base_tok}: sha256 differs from the manifest \(corrupted\); the "
                                                rf"model in {base_tok.parent} is damaged"):
        _run(ws)


DISK_FULL_RUN = """
import resource, sys
from rlhf_core.engine.loop import Hooks
from rlhf_core.trainers.sft import train_sft
from tests.rlhf_core.trainers.test_sft import tiny_params

def after_step(step, metrics):
    if step == 2:  # the step-2 checkpoint is written: from now on no file may grow past 64 KiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

train_sft(tiny_params(*sys.argv[2:]), sys.argv[1], hooks=Hooks(after_step=after_step))
"""


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint_and_says_so(ws, tmp_path):  # noqa: F811
    """A real write limit (RLIMIT_FSIZE: the kernel refuses to grow a file past 64 KiB, as a full disk or quota
    would) set after the step-2 checkpoint: saving step 4 fails, the error names it and the checkpoint that stays
    in force, `latest` still names step 2, and the re-run resumes there and ends with the uninterrupted weights."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    reference_ws = tmp_path / "reference"
    shutil.copytree(ws, reference_ws)
    _run(reference_ws)
    reference = _weights(reference_ws)

    proc = subprocess.run([sys.executable, "-c", DISK_FULL_RUN, str(ws), *STEPS], cwd=repo, capture_output=True,
                          text=True, timeout=600)
    ckpts = ws / "checkpoints/sft"
    said = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and "CheckpointSaveError" in said, proc.stderr[-3000:]
    assert f"{ckpts / 'step_00000004'}: saving the checkpoint failed (" in said
    assert f"); {ckpts / 'step_00000002'} stays the checkpoint a re-run resumes from" in said
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert not (ws / "models/sft/model.safetensors").exists()
    again = _run(ws)
    assert again["resumed_from_step"] == 2 and again["steps"] == 4
    for k, v in _weights(ws).items():
        assert torch.equal(v, reference[k]), k
