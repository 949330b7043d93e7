"""What the package claims about its install is true of the tested set of versions (``constraints.txt``)."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
MINORS = [f"3.{i}" for i in range(8, 20)]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^;\s#]+)", line.strip())
        if m:
            pins[m.group(1)] = m.group(3)
    return pins


def _admitted(spec: str | None) -> set[str]:
    return {v for v in MINORS if spec is None or SpecifierSet(spec).contains(f"{v}.0")}


def _lowest(minors: set[str]) -> str:
    return min(minors, key=lambda v: int(v.split(".")[1]))


def test_requires_python_is_the_lowest_python_the_pinned_set_installs_on():
    """``requires-python`` must not admit a Python that a pinned dependency refuses at the low end (the claim
    said >= 3.10 while transformers, pandas, typer and matplotlib need 3.11), nor exclude one they all take."""
    claim = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    pins = _pins()
    assert len(pins) > 100, "constraints.txt should pin the whole tested set"
    supported, needs = set(MINORS), {}
    for name, version in pins.items():
        meta = md.metadata(name)  # the tested set is what is installed here
        assert meta["Version"].split("+")[0] == version.split("+")[0], f"{name} {meta['Version']} != pin {version}"
        needs[name] = meta.get("Requires-Python")
        supported &= _admitted(needs[name])
    claimed = _lowest(_admitted(claim))
    assert claimed == _lowest(supported), (
        f"requires-python {claim!r}, but the pinned set installs on {sorted(supported)}; refusing {claimed}: "
        f"{ {k: v for k, v in needs.items() if claimed not in _admitted(v)} }")
    assert _admitted(claim) >= supported
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in _admitted(claim)


def test_every_declared_requirement_admits_the_tested_pin():
    """A dependency bound in pyproject.toml (e.g. the fastapi cap prefect needs) that the tested set violates
    would make `pip install rlhf-ops` and `make install` disagree."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {canonicalize_name(k): v for k, v in _pins().items()}
    declared = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    for line in declared:
        req = Requirement(line)
        if canonicalize_name(req.name) == canonicalize_name(project["name"]):  # an extra naming other extras
            assert req.extras <= set(project["optional-dependencies"]), line
            continue
        pin = pins.get(canonicalize_name(req.name))
        assert pin is not None, f"{req.name} is declared but not pinned in constraints.txt"
        assert req.specifier.contains(pin.split("+")[0], prereleases=True), f"{line!r} refuses the pin {pin}"
    assert any(Requirement(r).name == "fastapi" and not Requirement(r).specifier.contains("0.151.0")
               for r in project["optional-dependencies"]["orchestration"]), \
        "the fastapi cap prefect 3.8.8 needs is not declared with prefect"
