"""The documents installed with dpsql (``dpsql help TOPIC``).

The wheel carries the repository's README.md, grammar_notes.md and docs/*.md as package data
under dpsql/docs (symbolic links in the source tree: dpsql/docs/README.md, grammar_notes.md
and the directory dpsql/docs/docs; setuptools copies their targets into the sdist and wheel).
Topics are found from what is installed, so a new docs/*.md is a new topic.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

# Named topics; every other docs/NAME.md is the topic NAME.
NAMED = {"readme": "README.md", "grammar": "grammar_notes.md"}


def _docs() -> Traversable:
    return resources.files("dpsql").joinpath("docs")


def topics() -> dict[str, Traversable]:
    """Topic name -> its installed file."""
    root = _docs()
    out: dict[str, Traversable] = {}
    for topic, name in NAMED.items():
        if root.joinpath(name).is_file():
            out[topic] = root.joinpath(name)
    guide = root.joinpath("docs")
    if guide.is_dir():
        for item in sorted(guide.iterdir(), key=lambda t: t.name):
            if item.name.endswith(".md") and item.is_file():
                out.setdefault(item.name[: -len(".md")], item)
    return out


def title(doc: Traversable) -> str:
    """The document's first heading."""
    with doc.open(encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("# "):
                return line[2:].strip()
    return doc.name


def text(topic: str) -> str:
    return topics()[topic].read_text(encoding="utf-8")
