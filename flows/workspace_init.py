"""``rlhf init DIR``: a workspace for your own model and data, laid out from this source tree.

A workspace is the folder ``rlhf run`` runs in: the pipeline files at its top, the stages' outputs
(``data/prepared``, ``models/``, ``metrics/`` ...) and the embedded state (``.rlhf/``) written beside them. A
clone of this repository is one; ``init_workspace`` makes another from the source tree the running ``rlhf``
comes from (``SOURCE_ROOT``: the clone an editable install, ``pip install -e .``, points at). A wheel installed
from an index ships the packages only, not these files; there the clone is the workspace.

What ``DIR`` gets:

- ``dvc.yaml``, ``.dvcignore``, ``.gitignore``, ``prefect.yaml``: copied;
- ``rlhf_core``, ``flows``, ``configs``: symlinks into the source tree, so DVC fingerprints the code that runs
  (``dvc.yaml``'s code deps, ``.dvcignore`` applied) and ``prefect.yaml``'s entrypoints and profiles resolve;
- ``params.yaml``: ``data.source: per_phase`` with the given files and ``model.name_or_path`` (absolute paths,
  so they read the same from ``DIR``), the keys not given left as a commented template; validated first;
- ``git init`` and ``dvc init`` with the local remote under ``.rlhf/`` (``flows.local_pipeline.ensure_dvc``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

import flows
from flows.local_pipeline import ensure_dvc
from rlhf_core.config import DEFAULT_PARAMS, ConfigError, load_params
from rlhf_core.data.readers import DataError
from rlhf_core.ops.input_links import sync_input_links

SOURCE_ROOT = Path(flows.__file__).resolve().parent.parent
COPIED = ("dvc.yaml", ".dvcignore", ".gitignore", "prefect.yaml")
LINKED = ("rlhf_core", "flows", "configs")
WORKSPACE_FILE = "dvc.yaml"  # what makes a folder a workspace
PHASES = {
    "sft": "demonstrations: prompt/response or chat `messages` rows",
    "pairs": "preferences: prompt, chosen, rejected (or chat) rows",
    "prompts": "RL prompts: prompt rows (an `answer` column feeds a checker)",
}

NOT_A_WORKSPACE = (
    "{cwd} is not an rlhf-ops workspace (no dvc.yaml): a workspace is a clone of the rlhf-ops "
    "repository or a folder laid out by `rlhf init DIR`; run `rlhf init DIR`, then `rlhf run` in DIR"
)


def is_workspace(path: Path) -> bool:
    return (path / WORKSPACE_FILE).is_file()


def _absolute(spec: str, what: str, must_exist: bool) -> str:
    """A local path made absolute (it must exist when ``must_exist``); a Hub id or ``pkg:`` spec as given."""
    path = Path(spec).expanduser()
    if path.exists():
        return str(path.resolve())
    if must_exist or spec.startswith((".", "/", "~")):
        raise DataError(f"{what} {spec}: no such file or folder")
    return spec  # a Hub id (org/name) or a `pkg:` spec: prepare reads it


def render_params(name: str, model: str | None, files: dict[str, str | None], rm: str | None = None) -> str:
    """``params.yaml`` text for a workspace (what is not given stays a commented line to fill in)."""

    def q(value: str) -> str:
        return json.dumps(value)  # a JSON string is a YAML scalar, whatever the path holds

    lines = [
        "# rlhf-ops workspace params, laid out by `rlhf init` with these settings (every key is below; edit it",
        "# there; `rlhf params check` validates; docs/params.md in the rlhf-ops source documents each one).",
        "# data.max_prompt_len counts the tokens of the rendered prompt, chat template included: raise it for",
        "# long prompts (longer ones are dropped and counted, never cut).",
        "project:",
        f"  name: {q(name)}  # registered models: <name>-actor, <name>-reward, <name>-critic",
        "model:",
    ]
    if model:
        lines.append(f"  name_or_path: {q(model)}")
    else:
        lines += [
            "  # fill in: a local Hugging Face folder, a .gguf file or a Hub id (null: the tiny demo Llama)",
            "  name_or_path: null",
        ]
    lines += ["data:", "  source: per_phase", "  files:"]
    for phase, what in PHASES.items():
        if files.get(phase):
            lines.append(f"    {phase}: {{path: {q(files[phase])}}}  # {what}")
        else:
            lines.append(f"    {phase}: null  # fill in: {{path: /path/to/{phase}.jsonl}}; {what}")
    lines += ["rlhf:", "  reward_fns: {rm: 1.0}  # the reward model scores the rollouts"]
    yours = f"  external: {q(rm)}  # your reward model: scored on the held-out pairs, not trained"
    lines += ["rm:", yours] if rm else [
        "# rm:", "  # external: /path/to/your/reward-model  # a *ForSequenceClassification folder or Hub id"]
    lines += [
        "  # Without a checker for your task (eval.checker), a judge RM trained on held-out pairs",
        "  # decides the gate (else nothing is promoted; gates.allow_unjudged: true promotes anyway):",
        "  # judge: true",
        "",
    ]
    return "\n".join(lines)


def filled_in(text: str, params) -> str:
    """``params.yaml`` as DVC's stages need it, every key filled in (a stage whose params are missing from the
    file is refused), under ``text`` (what ``rlhf init`` was given, and what is left to decide) as comments."""
    notes = "\n".join(f"# {line}" if line and not line.startswith("#") else line for line in text.splitlines())
    return (f"{notes}\n# ---- every key, filled in with its default where not given above (DVC reads each stage's "
            "keys here) ----\n" + yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False, allow_unicode=True))


def init_workspace(
    target: Path,
    model: str | None = None,
    sft: str | None = None,
    pairs: str | None = None,
    prompts: str | None = None,
    force: bool = False,
    rm: str | None = None,
) -> Path:
    """Lay out the workspace ``target`` (see the module doc); returns it. ``DataError`` / ``ConfigError`` name what
    is wrong, before anything is written: a non-empty ``target`` (unless ``force``: the pipeline files are written
    over, the rest stays), a missing file, params that do not validate, a source tree without the pipeline files."""
    missing = [f for f in (*COPIED, DEFAULT_PARAMS) if not (SOURCE_ROOT / f).is_file()]
    if missing:
        raise DataError(
            f"{SOURCE_ROOT} has no {', '.join(missing)}: this rlhf is installed without the rlhf-ops "
            "source tree, which `rlhf init` copies from; clone the repository and install it with "
            "`pip install -e .` (or use the clone itself as the workspace)"
        )
    target = Path(target).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise DataError(f"{target} is a file, not a folder")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise DataError(
            f"{target} is not empty; `rlhf init` lays out a workspace in a new or empty folder "
            "(--force writes the pipeline files over what is there)"
        )
    files = {
        phase: _absolute(spec, f"--{phase}", must_exist=True) if spec else None
        for phase, spec in (("sft", sft), ("pairs", pairs), ("prompts", prompts))
    }
    model = _absolute(model, "--model", must_exist=False) if model else None
    rm = _absolute(rm, "--rm", must_exist=False) if rm else None
    text = render_params(target.name, model, files, rm)
    target.mkdir(parents=True, exist_ok=True)
    params_path = target / DEFAULT_PARAMS
    staged = target / f".{DEFAULT_PARAMS}.init"
    staged.write_text(text)
    try:
        params = load_params(staged)
    except ConfigError:
        staged.unlink()
        raise
    staged.write_text(filled_in(text, params))
    staged.replace(params_path)
    for name in COPIED:
        shutil.copy2(SOURCE_ROOT / name, target / name)
    for name in LINKED:
        link = target / name
        if link.is_symlink() or link.exists():
            if not link.is_symlink():
                raise DataError(f"{link} exists and is not a link into the source tree; remove it and re-run")
            link.unlink()
        link.symlink_to(SOURCE_ROOT / name, target_is_directory=True)
    if not (target / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=target, check=True)
    ensure_dvc(target, params.project.workspace)
    sync_input_links(params, target)  # inputs/: DVC's view of the files params.yaml names
    return target
