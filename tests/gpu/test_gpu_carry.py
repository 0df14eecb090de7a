"""The GPU carry's wheel repacking: wheels -> one xz tree -> the same wheels (file contents and modes)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

_spec = importlib.util.spec_from_file_location("wheel_tree", Path(__file__).resolve().parents[2] / "scripts" / "wheel_tree.py")
wheel_tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheel_tree)


def _make_wheel(path: Path, files: dict[str, tuple[bytes, int]]) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data)


def _contents(path: Path) -> dict[str, tuple[bytes, int]]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: (zf.read(i), (i.external_attr >> 16) & 0o777) for i in zf.infolist() if not i.is_dir()}


def test_wheels_survive_the_round_trip(tmp_path: Path) -> None:
    wheels = tmp_path / "in"
    wheels.mkdir()
    a = {"pkg/__init__.py": (b"x = 1\n" * 1000, 0o644), "pkg/tool.so": (bytes(range(256)) * 40, 0o755),
         "pkg-1.0.dist-info/METADATA": (b"Name: pkg\nVersion: 1.0\n", 0o644)}
    b = {"other/data/include/a.h": (b"#pragma once\n", 0o644), "other-2.0.dist-info/RECORD": (b"", 0o644)}
    _make_wheel(wheels / "pkg-1.0-py3-none-any.whl", a)
    _make_wheel(wheels / "other-2.0-cp312-cp312-manylinux_2_17_x86_64.whl", b)
    archive = tmp_path / "wheels.tar.xz"
    wheel_tree.pack(wheels, archive)
    back = tmp_path / "out"
    wheel_tree.unpack(archive, back)
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in wheels.iterdir())
    assert _contents(back / "pkg-1.0-py3-none-any.whl") == a
    assert _contents(back / "other-2.0-cp312-cp312-manylinux_2_17_x86_64.whl") == b


# --- what the GPU machine can import: its image plus the carry (tests/helpers/gpu_carry_check.py) ---

from packaging.requirements import Requirement  # noqa: E402

from tests.helpers.gpu_carry_check import carried_requirements, image_packages, normalize, uncovered  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CARRY_SCRIPT = ROOT / "scripts" / "gpu_carry.sh"


def test_carry_and_image_cover_every_third_party_import() -> None:
    """pytest there loads conftest first and the runtime imports grpc_reflection, gguf, fastapi...:
    a package neither carried nor in the image kills the run before any GPU test does anything."""
    missing = uncovered(ROOT, carried_requirements(CARRY_SCRIPT), image_packages(ROOT / "scripts" / "gpu_image_packages.txt"))
    assert not missing, "carry these in scripts/gpu_carry.sh (or explain why not):\n" + "\n".join(
        f"{m.distribution} (needed by {m.needed_by})" for m in missing)


def test_carried_packages_keep_pyproject_pins() -> None:
    """grpcio and its siblings must be carried at the version range the project pins (the
    generated stubs and the staleness check depend on it)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {normalize(r.name): r for r in map(Requirement, project["dependencies"] + project["optional-dependencies"]["gpu"])}
    carried = carried_requirements(CARRY_SCRIPT)
    assert "grpcio-reflection" in carried
    differing = {name: (str(carried[name].specifier), str(pinned[name].specifier))
                 for name in carried.keys() & pinned.keys() if carried[name].specifier != pinned[name].specifier}
    assert not differing, f"carried vs pyproject.toml: {differing}"


def test_carried_requirements_are_read_from_the_pip_lines(tmp_path: Path) -> None:
    script = tmp_path / "carry.sh"
    script.write_text('V=${V:-1.2}\nlist=(--python-version 3.12)\n"$PY" -m pip download --no-deps "${list[@]}" -d "$w" \\\n'
                      '    "a==$V" "b-c>=1,<2"  # comment\necho pip install d\n')
    assert {n: str(r) for n, r in carried_requirements(script).items()} == {"a": "a==1.2", "b-c": "b-c<2,>=1"}
