"""The Dockerfile, without a Docker engine: its base tag is the pin, the scripts it runs
exist and are the ones CI runs, hadolint passes, and the build-time self-check passes here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ddtree.upstream import pinned_version

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_base_image_tag_is_the_pin() -> None:
    default = re.search(r"^ARG VLLM_VERSION=(\S+)$", DOCKERFILE, re.M)
    assert default and default.group(1) == pinned_version()
    assert re.search(r"^FROM vllm/vllm-openai:v\$\{VLLM_VERSION\}$", DOCKERFILE, re.M)


def test_image_installs_with_the_script_ci_runs() -> None:
    scripts = re.findall(r"\b(scripts/[\w./-]+)", "\n".join(
        line for line in DOCKERFILE.splitlines() if not line.startswith("#")))
    assert scripts == ["scripts/setup_env.sh"]
    assert (REPO / scripts[0]).is_file()
    assert "scripts/setup_env.sh" in (REPO / "scripts/test.sh").read_text()
    assert "scripts/test.sh" in (REPO / ".ci/run").read_text()
    assert '"--image"' in DOCKERFILE or "--image" in DOCKERFILE
    assert 'ENTRYPOINT ["vllm", "serve"]' in DOCKERFILE


def test_the_cpu_standin_stays_out_of_the_image() -> None:
    assert "cpu_standin" in (REPO / ".dockerignore").read_text().splitlines()


def test_hadolint_passes() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(REPO / "Dockerfile")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_build_time_selfcheck_passes() -> None:
    result = subprocess.run([sys.executable, "-m", "vllm_ddtree.selfcheck"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vllm-ddtree selfcheck: all 10 checks passed" in result.stdout, result.stdout
