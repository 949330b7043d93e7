"""``rlhf init`` (a workspace for your own model and data: flows/workspace_init.py) and ``rlhf export`` (a
registered version as a Hugging Face folder, optionally pushed to the Hub: tasks/export.py), on the app of
:mod:`rlhf_core.cli`; exit 65 for input they refuse, 3 when the registry is unreachable."""

from __future__ import annotations

import subprocess
from pathlib import Path

import typer

from rlhf_core.cli import app, console, fail
from rlhf_core.config import DEFAULT_PARAMS, ConfigError, load_params
from rlhf_core.stages.exit_codes import BAD_INPUT


@app.command("init")
def init_cmd(
    directory: Path = typer.Argument(..., help="The workspace folder to lay out (new or empty)."),
    model: str = typer.Option(
        None,
        "--model",
        help="model.name_or_path: a local HF folder, a .gguf file or a Hub id; unset: a commented line to fill in.",
    ),
    sft: Path = typer.Option(None, "--sft", help="SFT demonstrations (data.files.sft)."),
    pairs: Path = typer.Option(None, "--pairs", help="Preference pairs for the reward model (data.files.pairs)."),
    prompts: Path = typer.Option(None, "--prompts", help="RL prompts (data.files.prompts)."),
    rm: str = typer.Option(None, "--rm", help="Your own reward model (rm.external): a folder or Hub id of a "
                                              "*ForSequenceClassification; unset: the RM stage trains one."),
    force: bool = typer.Option(False, "--force", help="Lay out the pipeline files in a folder that is not empty."),
) -> None:
    """Lay out a workspace for your own model and data: the pipeline files of this source tree, a params.yaml
    with `data.source: per_phase`, `git init` and `dvc init` (flows/workspace_init.py).

    Example: rlhf init ~/my-rlhf --model ~/models/my-llama --sft sft.jsonl --pairs pairs.jsonl --prompts p.jsonl
    """
    from flows.workspace_init import init_workspace
    from rlhf_core.data.readers import DataError

    try:
        target = init_workspace(directory, model, *(str(p) if p else None for p in (sft, pairs, prompts)), force=force,
                                rm=rm)
    except (DataError, ConfigError) as err:
        fail(str(err), code=BAD_INPUT)
    except subprocess.CalledProcessError as err:
        fail(f"`{' '.join(map(str, err.cmd))}` failed in {directory} (exit {err.returncode})", code=1)
    console.print(
        f"workspace laid out in {target}: edit params.yaml (`rlhf params check` validates it), then "
        f"`cd {target} && rlhf run`",
        highlight=False,
    )


@app.command("export")
def export_cmd(
    out: Path = typer.Option(
        ..., "--out", "-o", help="Folder to write the Hugging Face model folder to (new or empty)."
    ),
    kind: str = typer.Option("actor", "--kind", help="Registered model kind: actor | critic | reward (<prefix>-KIND)."),
    name: str = typer.Option(
        None,
        "--name",
        help="Registered model name (default <prefix>-KIND, prefix tracking.registry_prefix or project.name).",
    ),
    alias: str = typer.Option("champion", "--alias", help="Export the version this alias names."),
    version: str = typer.Option(None, "--version", help="Export this version number (wins over --alias)."),
    push_to_hub: str = typer.Option(
        None,
        "--push-to-hub",
        help="Then upload the folder to this Hub repo (org/name; needs a token: `hf auth login` or HF_TOKEN).",
    ),
    private: bool = typer.Option(False, "--private", help="Create the Hub repo private (when it does not exist)."),
    force: bool = typer.Option(False, "--force", help="Write into a folder that is not empty."),
) -> None:
    """Export a registered version (the champion by default) to a plain Hugging Face folder: merged
    safetensors weights, config, generation config, the tokenizer with its chat template, a model card,
    rlhf_meta.json; optionally push it to the Hub (tasks/export.py).

    Example: rlhf export --out exported/champion; rlhf export --version 3 --out v3 --push-to-hub me/my-rlhf-model
    """
    try:
        params = load_params(DEFAULT_PARAMS)  # only the registry's address and prefix: nothing set up here
    except ConfigError as err:
        fail(str(err))
    from rlhf_core.ops import tracking
    from tasks.export import ExportError, check_hub_access, export_version, push_folder

    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        fail(f"{out} is not empty; give a new folder or --force", code=BAD_INPUT)
    try:
        if push_to_hub:
            check_hub_access(push_to_hub)  # before the download: a push that cannot happen fails at once
        uri = tracking.tracking_uri(params)
        tracking.check_reachable(uri)
        done = export_version(
            uri,
            name or f"{tracking.registry_prefix(params)}-{kind}",
            out,
            alias=None if version else alias,
            version=version,
            params=params,
        )
        console.print(f"exported {done['name']} v{done['version']} ({done['kind']}) to {out}", highlight=False)
        if push_to_hub:
            url = push_folder(out, push_to_hub, private=private)
            console.print(f"pushed {out} to {url}", highlight=False)
    except tracking.TrackingUnavailable as err:
        fail(str(err), code=3)
    except (ExportError, ConfigError) as err:
        fail(str(err), code=BAD_INPUT)
