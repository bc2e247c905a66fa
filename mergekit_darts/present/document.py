"""Pages and tables the analysis writes: one markdown table rule, one page in markdown and HTML.

``mergekit-darts report`` builds a :class:`Document` once and writes it as ``report.md`` and
``report.html``; the sweep's ``results.md`` and ``stats.md`` use :func:`markdown_table`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Document:
    """A page built once and written as both markdown and HTML."""

    def __init__(self) -> None:
        self.blocks: list[tuple[str, Any]] = []

    def heading(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def text(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.blocks.append(("table", (list(header), [[str(c) for c in r] for r in rows])))

    def image(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", (path.name, alt)))

    def markdown(self) -> str:
        out = []
        for kind, value in self.blocks:
            if kind == "h":
                out.append("#" * value[0] + " " + value[1])
            elif kind == "p":
                out.append(value)
            elif kind == "table":
                out.append(markdown_table(*value))
            else:
                out.append(f"![{value[1]}]({value[0]})")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        e = html.escape
        out = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>{e(title)}</title><style>body{{font-family:sans-serif;max-width:1100px;"
            "margin:auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:2px 8px;text-align:right}img{max-width:100%}</style></head><body>",
        ]
        for kind, value in self.blocks:
            if kind == "h":
                out.append(f"<h{value[0]}>{e(value[1])}</h{value[0]}>")
            elif kind == "p":
                out.append(f"<p>{e(value)}</p>")
            elif kind == "table":
                header, rows = value
                out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
                out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
                out.append("</table>")
            else:
                out.append(f"<p><img src='{e(value[0])}' alt='{e(value[1])}'></p>")
        return "\n".join(out + ["</body></html>"]) + "\n"
