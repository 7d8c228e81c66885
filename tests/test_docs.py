"""README.md is a front door (at most 250 lines, the two commands first) and every relative link
in it, in docs/*.md and in the notebooks' text resolves to a file, and to a heading where it
names one."""

import json
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# .ci/run runs the README's first two ```bash blocks, in order: these, byte for byte
COMMANDS = [
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
    'eagle3-jax generate "A box holds 79 poukal. How many poukal are in 67 boxes?"',
    '. .venv/bin/activate && pip install -q -e ".[tpu]" && pip install -q --no-deps speculators==0.9.0 && '
    'python -m pytest -n 2 tests',
]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", text, re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\*|__|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(text: str) -> list[str]:
    return LINK.findall(INLINE_CODE.sub("", FENCE.sub("", text)))


def pages() -> list[tuple[Path, str]]:
    out = [(README, README.read_text())] + [(p, p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        out.append((nb, "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    return out


def broken_links(found=None, root: Path = ROOT) -> list[str]:
    bad = []
    for page, text in pages() if found is None else found:
        for target in links(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = page if not path else (page.parent / unquote(path)).resolve()
            where = f"{page.relative_to(root)}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif root not in dest.parents and dest != root:
                bad.append(f"{where} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no such heading)")
    return bad


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert [b.strip() for b in bash_blocks(text)[:2]] == COMMANDS
    # issue 59: the compile plan's command and an example of its table stay in the README
    pod = text.split("## Before you rent a pod", 1)[1].split("\n## ", 1)[0]
    assert "eagle3-jax plan --config configs/llama31_8b.yaml --topology v5e:2x4" in pod
    assert "compiled memory per device" in pod and "fits" in pod


def test_every_relative_link_resolves():
    assert broken_links() == []


def test_the_link_checker_catches_what_it_should(tmp_path):
    page = tmp_path.resolve() / "page.md"
    page.write_text("# A `code` title, here\n\n## Two budgets: B and K\n")
    assert anchors(page) == {"a-code-title-here", "two-budgets-b-and-k"}
    text = "see [x](a.md), ![fig](b.png), `[not](c.md)`, [web](https://e.org)\n```\n[no](d.md)\n```\n"
    assert links(text) == ["a.md", "b.png", "https://e.org"]
    (tmp_path / "a.md").write_text("# Here\n")
    found = [(page, "[ok](a.md#here) [gone](b.md) [no heading](a.md#there) [self](#two-budgets-b-and-k) [up](../x.md)")]
    assert broken_links(found, tmp_path.resolve()) == [
        "page.md: b.md (no such file)", "page.md: a.md#there (no such heading)"] + \
        (["page.md: ../x.md (outside the repository)"] if (tmp_path.parent / "x.md").exists() else
         ["page.md: ../x.md (no such file)"])
    assert bash_blocks("```bash\nls\n```\n```python\nx\n```\n```bash\npwd\n```\n") == ["ls\n", "pwd\n"]
