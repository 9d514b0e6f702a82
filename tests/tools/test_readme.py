"""The README stays a user's page: at most 200 lines, the details in docs/, every link to a
file of this repository resolving."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_readme_is_at_most_200_lines() -> None:
    assert len(README.splitlines()) <= 200, len(README.splitlines())


def test_readme_links_resolve() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if "://" not in link and not (REPO / link).exists()]
    assert not missing, missing
