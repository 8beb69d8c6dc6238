"""The Markdown files tell the truth about where things are: every relative link resolves to a
file or directory inside the repository, and no link leaves it for a sibling checkout."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".venv", ".git", "data", "runs", "bench-results", "node_modules", ".pytest_cache"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _markdown_files():
    for path in ROOT.rglob("*.md"):
        if not SKIP & set(path.relative_to(ROOT).parts):
            yield path


def test_every_relative_link_in_the_markdown_resolves_inside_the_repository():
    files = list(_markdown_files())
    assert ROOT / "README.md" in files and ROOT / "docs" / "architecture.md" in files
    broken = []
    for path in files:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # code is not links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same file
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.exists() or not resolved.is_relative_to(ROOT):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


def test_readme_starts_with_the_two_commands_and_lists_every_config_section():
    readme = (ROOT / "README.md").read_text()
    head = readme[: readme.index("\n## ")]
    assert "make demo" in head and "make test" in head
    # Nothing outside the repository, no internal source names ("seed 002").
    assert "](../" not in readme and not re.search(r"\bseeds? \d{3}\b", readme, re.IGNORECASE)
    for section in ("model", "parallel", "optimizer", "training", "data", "checkpoint", "logging"):
        assert f"[{section}]" in readme, section
