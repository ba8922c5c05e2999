"""The report as a document: a list of blocks written as HTML and as Markdown.

The report adds headings, paragraphs, links, tables, figures, code listings and definition
lists to a `Document`; `render_html` fills the Jinja2 template `templates/report.html.j2`
(self-contained: inline CSS, figures as base64 PNG; a link is navigation, never a resource
the page loads), `render_md` writes the Markdown twin (figures as links to their PNG and
SVG files) and `render_latex` the tables for a paper (`analysis.latex`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import jinja2

if TYPE_CHECKING:  # the document needs their fields only, not their modules
    from analysis.figures import FigureFile
    from analysis.tables import Table

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("analysis", "templates"),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)


@dataclass(frozen=True)
class Heading:
    """A section heading (the title is the only level above it)."""

    kind: ClassVar[str] = "heading"
    text: str


@dataclass(frozen=True)
class Paragraph:
    """A paragraph of plain text."""

    kind: ClassVar[str] = "paragraph"
    text: str
    note: bool = False  # a warning or a remark on what is missing, set apart


@dataclass(frozen=True)
class Link:
    """A sentence ending with a link (opens the MLflow UI on the study)."""

    kind: ClassVar[str] = "link"
    text: str
    url: str


@dataclass(frozen=True)
class TableBlock:
    """A table under its own title, caption below."""

    kind: ClassVar[str] = "table"
    table: Table


@dataclass(frozen=True)
class Figure:
    """A figure: embedded as PNG in the HTML, linked (PNG and SVG) from the Markdown."""

    kind: ClassVar[str] = "figure"
    figure: FigureFile
    png_link: str  # paths relative to the Markdown file
    svg_link: str

    @property
    def png_base64(self) -> str:
        return base64.b64encode(self.figure.png.read_bytes()).decode("ascii")


@dataclass(frozen=True)
class Code:
    """A verbatim listing (the study file)."""

    kind: ClassVar[str] = "code"
    text: str
    language: str = ""


@dataclass(frozen=True)
class Details:
    """A long text (a full error) behind a summary line."""

    kind: ClassVar[str] = "details"
    summary: str
    text: str


@dataclass(frozen=True)
class Definitions:
    """Name: value pairs (the provenance)."""

    kind: ClassVar[str] = "definitions"
    items: tuple[tuple[str, str], ...]


Block = Heading | Paragraph | Link | TableBlock | Figure | Code | Details | Definitions


class Document:
    """The blocks of the report, in order, under a title."""

    def __init__(self, title: str):
        self.title = title
        self.blocks: list[Block] = []

    def heading(self, text: str) -> None:
        self.blocks.append(Heading(text))

    def paragraph(self, text: str, note: bool = False) -> None:
        self.blocks.append(Paragraph(text, note))

    def link(self, text: str, url: str) -> None:
        self.blocks.append(Link(text, url))

    def table(self, table: Table) -> None:
        self.blocks.append(TableBlock(table))

    def figure(self, figure: FigureFile, md_dir: Path) -> None:
        self.blocks.append(
            Figure(figure, figure.png.relative_to(md_dir).as_posix(), figure.svg.relative_to(md_dir).as_posix())
        )

    def code(self, text: str, language: str = "") -> None:
        self.blocks.append(Code(text, language))

    def details(self, summary: str, text: str) -> None:
        self.blocks.append(Details(summary, text))

    def definitions(self, items: Sequence[tuple[str, str]]) -> None:
        self.blocks.append(Definitions(tuple(items)))

    def render_html(self) -> str:
        return _TEMPLATES.get_template("report.html.j2").render(title=self.title, blocks=self.blocks)

    def render_latex(self) -> str:
        from analysis.latex import tables_tex

        return tables_tex([b.table for b in self.blocks if isinstance(b, TableBlock)], self.title)

    def render_md(self) -> str:
        lines = [f"# {self.title}", ""]
        for block in self.blocks:
            lines += _MARKDOWN[block.kind](block)
        return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------- Markdown


def _md_escape(text: str) -> str:
    """Text safe inside a Markdown table cell or emphasis: no `|`, no line break."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _fence(text: str, language: str = "") -> str:
    """A fenced code block whose fence is longer than any run of backticks in `text`."""
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def _md_table(table: Table) -> str:
    lines = [
        "| " + " | ".join(_md_escape(h) for h in table.header) + " |",
        "|" + "|".join("---" for _ in table.header) + "|",
    ]
    for row in table.rows:
        entries = [
            (f"**{_md_escape(e.text)}**" if e.bold and e.text else _md_escape(e.text))
            + (f" ({_md_escape(e.detail)})" if e.detail else "")
            for e in row
        ]
        lines.append("| " + " | ".join(entries) + " |")
    if table.caption:
        lines += ["", f"*{_md_escape(table.caption)}*"]
    if table.note:
        lines += ["", f"> {_md_escape(table.note)}"]
    return "\n".join(lines)


_MARKDOWN = {
    "heading": lambda b: [f"## {b.text}", ""],
    "paragraph": lambda b: [b.text, ""],
    "link": lambda b: [f"{b.text} <{b.url}>", ""],
    "table": lambda b: [f"### {b.table.title}", "", _md_table(b.table), ""],
    "figure": lambda b: [
        f"![{b.figure.title}]({b.png_link})",
        "",
        f"*{b.figure.title}: {b.figure.caption}* ([SVG]({b.svg_link}))",
        "",
    ],
    "code": lambda b: [_fence(b.text, b.language), ""],
    "details": lambda b: [f"**{b.summary}**", "", _fence(b.text), ""],
    "definitions": lambda b: [f"- **{k}**: {_md_escape(v)}" for k, v in b.items] + [""],
}
