"""Every path the README and docs/*.md name exists in the checkout: paths under the
repository's folders (scripts/, tests/, docs/, patches/, vllm_ddtree/, csrc/, gpu_machine/,
cpu_standin/, models/; a test may follow as ``::name``), paths inside the package written
from vllm_ddtree/ (``spec_decode/verifier.py``), patch files by name (``0003-....patch``) and
relative markdown links. Globs, placeholders (``<...>``) and URLs are not paths; bare file
names without a folder are not checked.

Exempt, as records of their day: docs/rebase-*.md (reports of past rebases, naming the
series and files of then) and docs/test-suite-times.md (one run's times, by the paths of
then)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_ddtree"
ROOTS = ["scripts", "tests", "docs", "patches", "vllm_ddtree", "csrc", "gpu_machine",
         "cpu_standin", "models"]
# The package's folders: a path starting with one is read from vllm_ddtree/.
IN_PACKAGE = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
EXEMPT = ["docs/test-suite-times.md", *(f"docs/{p.name}" for p in REPO.glob("docs/rebase-*.md"))]
DOCS = ["README.md", *(f"docs/{p.name}" for p in sorted(REPO.glob("docs/*.md"))
                       if f"docs/{p.name}" not in EXEMPT)]

# Not inside a longer path, a URL or a variable.
_START = r"(?<![\w./~$-])"
PATH = re.compile(_START + rf"((?:{'|'.join(ROOTS + IN_PACKAGE)})/[\w./-]*)")
PATCH = re.compile(_START + r"(\d{4}-[\w.-]+\.patch)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
URL = re.compile(r"\w+://\S+")
CODE = re.compile(r"`[^`]*`")
NOT_A_PATH = "*<{[$"  # what follows a glob's or a placeholder's start


def named_paths(text: str) -> list[tuple[int, str, str]]:
    """(line, path as written, where it should be) of every path the markdown ``text``
    names: from the repository's root, or for a link (``./``) from the doc's folder."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for link in LINK.findall(CODE.sub("", line)):
            target = link.split("#")[0]
            if target and "://" not in link and not link.startswith("mailto:"):
                found.append((number, link, "./" + target))
        line = URL.sub(" ", LINK.sub(lambda m: "](" + " " * len(m[1]) + ")", line))
        for match in PATH.finditer(line):
            after = line[match.end():match.end() + 1]
            if after and after in NOT_A_PATH:
                continue
            path = match[1].rstrip(".,")
            root = path.split("/")[0]
            found.append((number, path, f"vllm_ddtree/{path}" if root in IN_PACKAGE else path))
        found += [(number, name, f"patches/{name}") for name in PATCH.findall(line)]
    return found


def test_named_paths_reads_paths_not_globs_placeholders_or_urls() -> None:
    text = ("Run `tests/engine/test_ddtree.py::test_x` and scripts/test.sh.\n"
            "Not `tests/ops/test_tree_*.py`, docs/rebase-<version>.md, "
            "https://github.com/o/r/blob/main/tests/x.py, $OUT/docs/x, /tmp/docs/y,\n"
            "but [the port](v2-port.md#status), `spec_decode/verifier.py` and "
            "0010-cpu-amx-permission-before-amx-kernels.patch.")
    assert named_paths(text) == [
        (1, "tests/engine/test_ddtree.py", "tests/engine/test_ddtree.py"),
        (1, "scripts/test.sh", "scripts/test.sh"),
        (3, "v2-port.md#status", "./v2-port.md"),
        (3, "spec_decode/verifier.py", "vllm_ddtree/spec_decode/verifier.py"),
        (3, "0010-cpu-amx-permission-before-amx-kernels.patch",
         "patches/0010-cpu-amx-permission-before-amx-kernels.patch")]


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc: str) -> None:
    folder = (REPO / doc).parent
    missing = [f"{doc}:{line}: {path}" for line, path, where in
               named_paths((REPO / doc).read_text())
               if not ((folder if where.startswith("./") else REPO) / where).exists()]
    assert not missing, "named but not in the checkout:\n" + "\n".join(missing)


def test_the_exempt_records_exist() -> None:
    assert (REPO / "docs/test-suite-times.md").exists() and len(EXEMPT) > 1, EXEMPT
