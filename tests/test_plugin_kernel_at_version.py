"""tools/kernel_at_version.py: the oldest declared kernel, from the tree or a git tag."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

TOOL = Path(__file__).resolve().parent.parent / "tools" / "kernel_at_version.py"


@pytest.fixture(scope="module")
def tool():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("kernel_at_version", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plugin_dir(tmp_path: Path, requirement: str) -> Path:
    (tmp_path / "pyproject.toml").write_text(f'[project]\nname = "fv-x"\nversion = "1"\ndependencies = ["torch", "{requirement}"]\n')
    return tmp_path


def test_minimum_version_is_the_lower_bound(tool, tmp_path: Path) -> None:  # noqa: ANN001
    assert tool.minimum_kernel_version(plugin_dir(tmp_path, "fv-kernel>=0.1,<0.2")) == Version("0.1")
    with pytest.raises(tool.KernelVersionError, match="has no lower bound"):
        tool.minimum_kernel_version(plugin_dir(tmp_path, "fv-kernel<2"))


def test_current_version_uses_the_tree_and_older_ones_the_tag(tool, tmp_path: Path) -> None:  # noqa: ANN001
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    (repo / "pyproject.toml").write_text('[project]\nname = "fv-kernel"\nversion = "0.1.0"\n')
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "v0.1"], check=True)
    subprocess.run([*git, "tag", "fv-kernel-v0.1.0"], check=True)
    (repo / "pyproject.toml").write_text('[project]\nname = "fv-kernel"\nversion = "0.2.0"\n')
    assert tool.kernel_source(Version("0.2"), tmp_path / "a", repo=repo) == repo
    exported = tool.kernel_source(Version("0.1.0"), tmp_path / "b", repo=repo)
    assert 'version = "0.1.0"' in (exported / "pyproject.toml").read_text()
    with pytest.raises(tool.KernelVersionError, match="tag 'fv-kernel-v0.0.9'"):
        tool.kernel_source(Version("0.0.9"), tmp_path / "c", repo=repo)


def _repo_with_tag(tmp_path: Path, tagged: str, current: str) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    (repo / "pyproject.toml").write_text(f'[project]\nname = "fv-kernel"\nversion = "{tagged}"\n')
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "old"], check=True)
    subprocess.run([*git, "tag", f"fv-kernel-v{tagged}"], check=True)
    (repo / "pyproject.toml").write_text(f'[project]\nname = "fv-kernel"\nversion = "{current}"\n')
    return repo


FAILING = [sys.executable, "-c", "raise SystemExit(3)"]


def test_kmin_runs_nothing_when_the_minimum_is_the_current_kernel(tool, tmp_path: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    repo = _repo_with_tag(tmp_path, "0.1.0", "0.2.0")
    plugin = plugin_dir(tmp_path, "fv-kernel>=0.2,<0.3")
    installed: list[tuple[str, ...]] = []
    monkeypatch.setattr(tool, "_pip_install", lambda *targets: installed.append(targets))
    assert tool.run_against_minimum(plugin, [], FAILING, repo=repo, first=["torch==2.13.0"]) == 0
    assert "is the current kernel" in capsys.readouterr().out
    assert installed == []  # not even torch: the kmin env stays without it


def test_kmin_installs_the_older_kernel_and_runs_the_command(tool, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    repo = _repo_with_tag(tmp_path, "0.1.0", "0.2.0")
    (tmp_path / "p").mkdir()
    plugin = plugin_dir(tmp_path / "p", "fv-kernel>=0.1,<0.3")  # ">=0.1" finds the tag fv-kernel-v0.1.0
    installed: list[tuple[str, ...]] = []
    monkeypatch.setattr(tool, "_install_kernel", lambda source: installed.append(("kernel", (source / "pyproject.toml").read_text())))
    monkeypatch.setattr(tool, "_pip_install", lambda *targets: installed.append(targets))
    code = tool.run_against_minimum(plugin, ["deps/fv-wan[test]"], FAILING, repo=repo, first=["torch==2.13.0"])
    assert code == 3  # the command's exit code
    assert installed[0] == ("torch==2.13.0",)  # before the kernel, whose torch requirement it satisfies
    assert installed[1][0] == "kernel" and 'version = "0.1.0"' in installed[1][1]
    assert installed[2:] == [("-e", "deps/fv-wan[test]"), ("-e", f"{plugin}[test]")]
