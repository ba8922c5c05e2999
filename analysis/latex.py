"""The report's tables as LaTeX (booktabs), ready to paste into a paper: `tables.tex`.

Each `analysis.tables.Table` marked for the paper becomes a `table` float holding a
`tabular` (or a `longtable` past `LONG_ROWS` rows, which a page cannot hold) with
`\\toprule`, `\\midrule` and `\\bottomrule`, its caption above and a label derived from its
title. Published numbers keep their own columns, one per source ("... (paper)", "...
([GSJS22])"), as in the HTML. Text is
escaped for LaTeX; the few non-ASCII signs the report writes (±, –, −, ≤, ≥, ≠, …, the Greek
symbols of parameters) become
their LaTeX forms, so the file compiles with pdflatex as it is.

The preamble a paper needs is listed at the top of the file: `\\usepackage{booktabs}` (and
`longtable` when a table is long).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from analysis.tables import Table

#: Tables with more rows are written as a `longtable` (it breaks across pages).
LONG_ROWS = 40

_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
    "±": r"$\pm$",
    "–": "--",
    "—": "---",
    "−": "$-$",
    "≤": r"$\leq$",
    "≥": r"$\geq$",
    "≠": r"$\neq$",
    "…": r"\ldots{}",
    "×": r"$\times$",
    "\u2009": r"\,",
    "\u00a0": "~",
    "`": r"\textasciigrave{}",
    # the papers' symbols of parameters (analysis.formatting.SYMBOLS)
    "ε": r"$\varepsilon$",
    "τ": r"$\tau$",
    "α": r"$\alpha$",
    "β": r"$\beta$",
    "λ": r"$\lambda$",
    "γ": r"$\gamma$",
}
_PATTERN = re.compile("|".join(re.escape(c) for c in sorted(_SPECIAL, key=len, reverse=True)))


def escape(text: str) -> str:
    """`text` as LaTeX source: special characters escaped, the report's signs as LaTeX."""
    return _PATTERN.sub(lambda m: _SPECIAL[m.group(0)], text)


def label_of(title: str, used: set[str]) -> str:
    """`tab:<slug of the title>`, unique among `used` (which it joins)."""
    base = "tab:" + (re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "table")
    label, i = base, 2
    while label in used:
        label, i = f"{base}-{i}", i + 1
    used.add(label)
    return label


def _row(cells: Sequence[str]) -> str:
    return " & ".join(cells) + r" \\"


def _entry(entry) -> str:
    text = escape(entry.text)
    text = rf"\textbf{{{text}}}" if entry.bold and entry.text else text
    return text + (rf" {{\scriptsize {escape(entry.detail)}}}" if entry.detail else "")


def table_tex(table: Table, label: str) -> str:
    """One table as a booktabs float (or longtable)."""
    columns = "".join("l" if i < table.label_columns else "r" for i in range(len(table.header)))
    header = _row([escape(h) for h in table.header])
    body = [_row([_entry(e) for e in row]) for row in table.rows]
    note = f" {escape(table.note)}" if table.note else ""
    caption = rf"\caption{{{escape(table.title)}. {escape(table.caption)}{note}}}\label{{{label}}}"
    if len(table.rows) > LONG_ROWS:
        return "\n".join(
            [
                r"{\small",
                rf"\begin{{longtable}}{{{columns}}}",
                caption + r" \\",
                r"\toprule",
                header,
                r"\midrule",
                r"\endfirsthead",
                r"\toprule",
                header,
                r"\midrule",
                r"\endhead",
                r"\bottomrule",
                r"\endlastfoot",
                *body,
                r"\end{longtable}",
                "}",
            ]
        )
    return "\n".join(
        [
            r"\begin{table}[htbp]",
            r"\centering",
            r"\small",
            caption,
            rf"\begin{{tabular}}{{{columns}}}",
            r"\toprule",
            header,
            r"\midrule",
            *body,
            r"\bottomrule",
            r"\end{tabular}",
            r"\end{table}",
        ]
    )


def tables_tex(tables: Sequence[Table], title: str) -> str:
    """The file `tables.tex`: every table for the paper, with the packages they need."""
    tables = [t for t in tables if t.paper]
    used: set[str] = set()
    long = any(len(t.rows) > LONG_ROWS for t in tables)
    packages = r"\usepackage{booktabs}" + (r" \usepackage{longtable}" if long else "")
    parts = [
        f"% {escape(title)}: the report's tables (written by analysis.report).",
        f"% Needs in the preamble: {packages}",
        "",
    ]
    if not tables:
        parts.append("% No table: the study has no finished cell.")
    for table in tables:
        parts += [table_tex(table, label_of(table.title, used)), ""]
    return "\n".join(parts).rstrip() + "\n"
