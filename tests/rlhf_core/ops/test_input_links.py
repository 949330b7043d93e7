"""``inputs/``: links to what params.yaml names, re-made from params, never anything else touched."""

from __future__ import annotations

import pytest

from rlhf_core.ops.input_links import sync_input_links
from tests.conftest import make_params, write_jsonl


def per_phase(tmp_path, **extra):
    (tmp_path / "mine").mkdir()
    for name in ("sft", "pairs", "prompts"):
        write_jsonl(tmp_path / "mine" / f"{name}.jsonl", [{"prompt": "q"}])
    files = {name: {"path": str(tmp_path / "mine" / f"{name}.jsonl")} for name in ("sft", "pairs", "prompts")}
    return make_params(base={"data": {"source": "per_phase", "files": files}, **extra})


def test_files_and_folders_are_linked_by_group(tmp_path):
    model = tmp_path / "my-model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "w.bin").write_bytes(b"w")
    (model / ".cache").mkdir()
    (model / ".cache" / "junk").write_text("x")
    ws = tmp_path / "ws"
    ws.mkdir()
    params = per_phase(tmp_path, model={"name_or_path": str(model), "tokenizer": "org/hub-id"},
                       rm={"external": str(model)})
    out = sync_input_links(params, ws)
    assert out["data"] == {f"{n}.jsonl": str(tmp_path / "mine" / f"{n}.jsonl") for n in ("sft", "pairs", "prompts")}
    assert out["model"] == {"base": str(model)} and out["rm"] == {"external": str(model)}  # a Hub id: not linked
    link = ws / "inputs" / "data" / "sft.jsonl"
    assert link.is_symlink() and link.resolve() == tmp_path / "mine" / "sft.jsonl"
    files = sorted(p.relative_to(ws / "inputs" / "model").as_posix() for p in (ws / "inputs" / "model").rglob("*")
                   if p.is_symlink())
    assert files == ["base/config.json", "base/sub/w.bin"]  # a link per file; caches skipped
    assert (ws / "inputs" / "model" / "base").is_dir() and not (ws / "inputs" / "model" / "base").is_symlink()

    demo = make_params()  # back to the demo: every link goes, the folders stay
    assert sync_input_links(demo, ws) == {"data": {}, "model": {}, "rm": {}}
    assert sorted(p.name for p in (ws / "inputs").rglob("*")) == [".gitkeep"] * 3 + ["data", "model", "rm"]
    assert (model / "sub" / "w.bin").read_bytes() == b"w"  # their folder untouched


def test_a_file_put_in_inputs_is_an_error_not_deleted(tmp_path):
    ws = tmp_path / "ws"
    (ws / "inputs" / "data").mkdir(parents=True)
    (ws / "inputs" / "data" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"inputs/data/notes\.txt: not a link"):
        sync_input_links(make_params(), ws)
    assert (ws / "inputs" / "data" / "notes.txt").read_text() == "mine"
