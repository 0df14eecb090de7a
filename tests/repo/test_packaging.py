"""The package keeps building with the setuptools to come: `project.license` is an SPDX expression
(a TOML table is deprecated, and setuptools stops building such projects after 2027-02-18), the
license files it names exist, and the container image copies them in before it installs."""

from __future__ import annotations

import tomllib

from hetero_infer.bench.harness import REPO_ROOT


def _project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_is_an_spdx_string_with_its_files_named() -> None:
    project = _project()
    assert isinstance(project["license"], str), "project.license: an SPDX string such as \"Apache-2.0\", not a table"
    assert project["license-files"], "project.license-files: name the license text"
    for pattern in project["license-files"]:
        assert list(REPO_ROOT.glob(pattern)), f"license-files pattern {pattern!r} matches no file"


def test_the_image_copies_the_license_files_before_installing() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text().splitlines()
    install = next(i for i, line in enumerate(dockerfile) if line.startswith("RUN pip install \"."))
    copied = {word for line in dockerfile[:install] if line.startswith("COPY ") for word in line.split()[1:-1]}
    for pattern in _project()["license-files"]:
        assert pattern in copied, f"the Dockerfile installs the package without copying {pattern}"
