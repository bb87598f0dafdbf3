"""A small element tree from HTML text (the standard library's parser), enough to check a page's
tables, folded blocks and code blocks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID = {"br", "hr", "img", "input", "meta", "link", "use", "col", "wbr", "source"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str | None] = field(default_factory=dict)
    children: list[Element | str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self, tag: str) -> Iterator[Element]:
        for c in self.children:
            if isinstance(c, Element):
                if c.tag == tag:
                    yield c
                yield from c.iter(tag)

    def find(self, tag: str) -> Element | None:
        return next(self.iter(tag), None)


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#root")
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, dict(attrs))
        self.stack[-1].children.append(el)
        if tag not in VOID:
            self.stack.append(el)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Element(tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return
        raise AssertionError(f"</{tag}> closes nothing that is open")

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(html: str) -> Element:
    """The tree of ``html``; raises AssertionError on an end tag that closes nothing."""
    b = _Builder()
    b.feed(html)
    b.close()
    return b.root


def table_rows(table: Element) -> list[list[str]]:
    """Each row's cell texts, the header row first."""
    return [
        [cell.text() for cell in row.children if isinstance(cell, Element) and cell.tag in ("th", "td")]
        for row in table.iter("tr")
    ]
