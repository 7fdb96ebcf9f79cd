"""Code comments and docs cite design notes inside the repository only: every
"docs/design.md, pitfall N" names a pitfall that exists there, and nothing points at
design notes outside the repository (a ``../shared`` path, "DESIGN.md lesson N")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SOURCES = sorted(
    p for folder in ("annot", "examples", "tests", ".ci", "docs") for p in (ROOT / folder).rglob("*")
    if p.suffix in {".py", ".md", ".toml"} and "golden" not in p.parts and "data" not in p.parts
) + [ROOT / "README.md"]
THIS = Path(__file__).resolve()


def _pitfall_numbers() -> set[int]:
    text = DESIGN.read_text()
    section = text[text.index("## Pitfalls the code must carry"):]
    section = section[:section.index("\n## ", 1)]
    return {int(n) for n in re.findall(r"^(\d+)\. ", section, flags=re.M)}


def test_the_pitfalls_are_numbered_one_to_n():
    numbers = _pitfall_numbers()
    assert numbers == set(range(1, len(numbers) + 1)) and len(numbers) >= 20


def test_every_cited_pitfall_exists():
    numbers = _pitfall_numbers()
    cited = re.compile(r"pitfalls? (\d+(?:(?:, | and |-)\d+)*)")
    missing = []
    for path in SOURCES:
        if path == THIS:
            continue
        for match in cited.finditer(path.read_text(errors="replace")):
            for n in map(int, re.findall(r"\d+", match.group(1))):
                if n not in numbers:
                    missing.append(f"{path.relative_to(ROOT)}: pitfall {n}")
    assert not missing, "\n".join(missing)


def test_nothing_cites_notes_outside_the_repository():
    outside = re.compile(r"\.\./shared|DESIGN\.md|lesson \d")
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in SOURCES if path != THIS
             for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if outside.search(line)]
    assert not found, "\n".join(found)
