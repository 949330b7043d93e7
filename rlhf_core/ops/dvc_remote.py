"""A stage under DVC against a shared remote, where there is no git: ``rlhf repro STAGE --remote URL``.

A checkout keeps two things apart: the data (DVC's cache, pushed to a remote) and the small files git commits
(``params.yaml``, ``dvc.lock``, the uncached metrics, plots and reports). A cluster pod has no git, so both
live on the remote: the data in DVC's own layout under ``URL``, the rest as plain objects under
``URL/rlhf-state/`` (the *state*). One stage run (:func:`repro`):

1. the workspace becomes a DVC project if it is not one (``dvc init --no-scm``), with ``dvc.yaml`` and the
   source files the stages depend on copied from the installed project (so ``dvc.lock`` hashes the code that
   ran), and ``URL`` as its default remote (``.dvc/config.local``);
2. the state is downloaded: ``dvc.lock``, the uncached outputs, and ``params.yaml`` unless the caller gives one;
3. ``dvc repro --single-item STAGE --pull``: DVC pulls the inputs the workspace lacks and skips the stage when
   nothing it depends on changed (then it also pulls the stage's outputs);
4. after a run, a run-cache restore, or when the workspace's lock entry for the stage is ahead of the state's
   (an earlier attempt here ran, then its push failed): ``dvc push STAGE`` (its outputs), then, if the state's
   ``dvc.lock`` is still the one fetched in step 2, the state is uploaded, ``dvc.lock`` last, so the state never
   names data the remote lacks and a lock another writer published meanwhile is not overwritten.

The stages of one pipeline run one after another (a flow holds its workspace slot), so the state has one
writer at a time. :func:`pull_outputs` is the reader's side: the registering flow fetches models from the
remote instead of reading the stage pods' volume. The URL is anything DVC and fsspec both read: ``s3://``
(``dvc-s3``; an S3-compatible server such as MinIO through ``AWS_ENDPOINT_URL``), ``gs://`` (``dvc-gs``),
``azure://`` or a local path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from rlhf_core.ops.dvc_repro import ReproOutcome, run_repro, stage_env

STATE_DIR = "rlhf-state"
REMOTE_NAME = "rlhf"
REMOTE_ENV = "RLHF_DVC_REMOTE"  # `rlhf repro`'s remote URL when ``--remote`` is not given
PROJECT_DIR_ENV = "RLHF_PROJECT_DIR"  # where dvc.yaml and the stage sources are (else found, see project_dir)
IMAGE_PROJECT_DIR = Path("/opt/rlhf-ops")  # the images keep the project source there (docker/)
PARAMS = "params.yaml"
LOCK = "dvc.lock"


class RemoteStateError(RuntimeError):
    """The remote or the workspace cannot serve a stage run; ``missing_params`` when only the params lack."""

    def __init__(self, message: str, missing_params: bool = False):
        super().__init__(message)
        self.missing_params = missing_params


def project_dir() -> Path:
    """The folder holding ``dvc.yaml`` and the stage sources: ``$RLHF_PROJECT_DIR``, else this checkout (an
    editable install), else the image's ``/opt/rlhf-ops``."""
    given = os.environ.get(PROJECT_DIR_ENV)
    candidates = [Path(given)] if given else [Path(__file__).resolve().parents[2], IMAGE_PROJECT_DIR]
    for candidate in candidates:
        if (candidate / "dvc.yaml").is_file():
            return candidate
    raise RemoteStateError(f"no dvc.yaml in {', '.join(map(str, candidates))}: set {PROJECT_DIR_ENV} to the "
                           "rlhf-ops project folder")


def read_stages(root: Path) -> dict:
    return (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})


def _paths(entries: list) -> list[tuple[str, dict]]:
    """``outs``/``metrics``/``plots``/``deps`` entries as ``(path, options)`` (an entry is a path or a 1-key map)."""
    found = []
    for entry in entries or []:
        if isinstance(entry, dict):
            ((path, options),) = entry.items()
            found.append((path, options or {}))
        else:
            found.append((entry, {}))
    return found


def outputs(stage: dict) -> list[tuple[str, dict]]:
    return [o for key in ("outs", "metrics", "plots") for o in _paths(stage.get(key, []))]


def uncached_outputs(stages: dict, name: str) -> list[str]:
    """The outputs of stage ``name`` that DVC does not cache (``cache: false``): what git would carry."""
    return [path for path, opts in outputs(stages[name]) if opts.get("cache", True) is False]


def source_deps(stages: dict, project: Path) -> list[str]:
    """The top-level files and folders of the dependencies no stage produces and the project holds: the code,
    as whole packages (``rlhf_core``, not the modules listed): ``python -m`` (torchrun's workers) puts the
    working folder first on ``sys.path``, so a partial copy there would shadow the installed package."""
    produced = {path for stage in stages.values() for path, _ in outputs(stage)}
    deps = {path for stage in stages.values() for path, _ in _paths(stage.get("deps", []))}
    return sorted({Path(d).parts[0] for d in deps - produced if (project / d).exists()})


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=stage_env(), capture_output=True,
                          text=True)


def _checked(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise RemoteStateError(f"{what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr).strip()}")


def prepare_workspace(root: Path, url: str, project: Path | None = None, with_sources: bool = True,
                      default: bool = True) -> dict:
    """Make ``root`` a DVC project running this installation's pipeline against ``url`` (the remote ``rlhf``,
    the default one unless ``default`` is false); returns its stages."""
    project = project or project_dir()
    root.mkdir(parents=True, exist_ok=True)
    if not (root / ".dvc").is_dir():
        _checked(_dvc(root, "init", "--no-scm", "-q"), f"dvc init in {root}")
    same = root.resolve() == project.resolve()
    if not same:
        shutil.copyfile(project / "dvc.yaml", root / "dvc.yaml")
        if (project / ".dvcignore").is_file():  # bytecode and caches are never a stage's input
            shutil.copyfile(project / ".dvcignore", root / ".dvcignore")
    stages = read_stages(root)
    if with_sources and not same:
        for dep in source_deps(stages, project):
            src, dst = project / dep, root / dep
            if src.is_dir():
                shutil.rmtree(dst, ignore_errors=True)  # a module deleted upstream must not linger in the hash
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
    _checked(_dvc(root, "remote", "add", "--local", "--force", *(["--default"] * default), REMOTE_NAME, url),
             f"dvc remote add {REMOTE_NAME} {url}")
    return stages


class RemoteState:
    """The plain objects under ``URL/rlhf-state/``: ``params.yaml``, ``dvc.lock``, the uncached outputs."""

    def __init__(self, url: str):
        from fsspec.core import url_to_fs

        self.where = f"{url.rstrip('/')}/{STATE_DIR}"
        # a fresh instance: fsspec caches instances and their listings, and the pods write between two reads
        self.fs, self.path = url_to_fs(self.where, skip_instance_cache=True)

    def _remote(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def download(self, root: Path, names: Sequence[str]) -> list[str]:
        """Fetch each of ``names`` the state holds into ``root`` (each replaced atomically); returns those found."""
        found = []
        self.fs.invalidate_cache()
        for name in names:
            remote = self._remote(name)
            if not self.fs.exists(remote):
                continue
            local = root / name
            local.parent.mkdir(parents=True, exist_ok=True)
            partial = local.with_name(f".{local.name}.partial")
            self.fs.get_file(remote, str(partial))
            os.replace(partial, local)
            found.append(name)
        return found

    def read(self, name: str) -> bytes | None:
        self.fs.invalidate_cache()
        remote = self._remote(name)
        return self.fs.cat_file(remote) if self.fs.exists(remote) else None

    def refuse_if_changed(self, name: str, fetched: bytes | None) -> None:
        """Raise :class:`RemoteStateError` when ``name`` is no longer what this run fetched: another writer
        published in between, and uploading now would drop its stage from the lock (last writer wins). The
        check and the upload are two requests, so this narrows the race rather than closing it; one flow per
        remote (the flow's concurrency limit) closes it."""
        now = self.read(name)
        if now != fetched:
            raise RemoteStateError(f"{self.where}/{name} changed while this stage ran (another pipeline on the same "
                                   "remote?): not overwriting it; the outputs are pushed, re-run the stage to "
                                   "publish them on top of the new state")

    def upload(self, root: Path, names: Sequence[str]) -> list[str]:
        """Put each of ``names`` that exists in ``root`` into the state; returns those uploaded."""
        sent = []
        for name in names:
            local = root / name
            if local.is_file():
                self.fs.makedirs(self._remote(name).rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(local), self._remote(name))
                sent.append(name)
        return sent


def state_files(stages: dict) -> list[str]:
    """What the state may hold, ``dvc.lock`` last: every stage's uncached outputs, then the lock."""
    return [path for name in stages for path in uncached_outputs(stages, name)] + [LOCK]


def repro(stage: str, root: Path, url: str, params_file: Path | None = None, force: bool = False,
          echo: Callable[[str], None] = print,
          started: Callable[[subprocess.Popen], None] | None = None) -> ReproOutcome:
    """Run ``stage`` in ``root`` under DVC against the remote ``url`` (the module docstring's four steps).

    ``params_file`` (a file) becomes the workspace's ``params.yaml`` and, once the stage has succeeded, the
    state's; without it the state's ``params.yaml`` is used, and a state without one is a
    :class:`RemoteStateError` with ``missing_params``.
    """
    stages = prepare_workspace(root, url)
    if stage not in stages:
        raise RemoteStateError(f"stage {stage!r} is not in dvc.yaml (stages: {', '.join(stages)})")
    state = RemoteState(url)
    fetched = state.download(root, [PARAMS] * (params_file is None) + state_files(stages))
    echo(f"state {state.where}: fetched {', '.join(fetched) or 'nothing (a new pipeline)'}")
    if params_file is not None:
        if not (root / PARAMS).exists() or not (root / PARAMS).samefile(params_file):
            shutil.copyfile(params_file, root / PARAMS)
    elif PARAMS not in fetched:
        raise RemoteStateError(f"{state.where}/{PARAMS} does not exist: pass --params FILE (it is uploaded with "
                               "the stage's results) or start the pipeline from the flow, which uploads it",
                               missing_params=True)
    state_lock = (root / LOCK).read_bytes() if LOCK in fetched else None
    outcome = run_repro(stage, root, stage_env(), echo, force=force, extra_args=["--pull"], started=started)
    if outcome.returncode != 0:
        return outcome
    behind = locked_entry(root / LOCK, stage) != locked_entry_of(state_lock, stage)
    publish = outcome.status == "ran" or behind  # behind: an earlier attempt here ran and failed to publish
    if publish:
        _checked(_dvc(root, "push", stage), f"dvc push {stage} to {url}")
        state.refuse_if_changed(LOCK, state_lock)
    sent = state.upload(root, [PARAMS] * (params_file is not None)
                        + (uncached_outputs(stages, stage) + [LOCK]) * publish)
    echo(f"state {state.where}: uploaded {', '.join(sent) or 'nothing (the stage was up to date)'}")
    return outcome


def locked_entry_of(lock: bytes | None, stage: str) -> dict | None:
    """Stage ``stage``'s entry in the text of a ``dvc.lock`` (None: no lock, or the stage not in it)."""
    return ((yaml.safe_load(lock) or {}).get("stages") or {}).get(stage) if lock else None


def locked_entry(path: Path, stage: str) -> dict | None:
    return locked_entry_of(path.read_bytes() if path.is_file() else None, stage)


def fetch_state(root: Path, url: str) -> list[str]:
    """The state's files (``dvc.lock``, metrics, plots, reports) into ``root``, which needs no DVC project;
    ``dvc.yaml`` from the project says which files those are."""
    return RemoteState(url).download(root, state_files(read_stages(project_dir())))


def publish_params(root: Path, url: str) -> None:
    """``root/params.yaml`` becomes the state's: the stages run by ``rlhf repro`` without ``--params`` read it."""
    if not RemoteState(url).upload(root, [PARAMS]):
        raise RemoteStateError(f"{root / PARAMS} does not exist")


def pull_outputs(root: Path, url: str, stages_wanted: Sequence[str], echo: Callable[[str], None] = print) -> None:
    """The reader's side: ``root`` gets the state's files and the outputs of ``stages_wanted`` from the remote
    (``dvc pull STAGE...``); a stage the state's ``dvc.lock`` does not list yet is left out."""
    stages = prepare_workspace(root, url, with_sources=False, default=False)  # a checkout keeps its own default
    state = RemoteState(url)
    fetched = state.download(root, state_files(stages))
    locked = (yaml.safe_load((root / LOCK).read_text()) or {}).get("stages", {}) if LOCK in fetched else {}
    targets = [s for s in stages_wanted if s in locked]
    if targets:
        _checked(_dvc(root, "pull", "--remote", REMOTE_NAME, *targets), f"dvc pull {' '.join(targets)} from {url}")
    echo(f"pulled {', '.join(targets) or 'nothing'} from {url}")
