"""The product touches no private attribute of anyone else's object.

A private attribute (``x._name``: one leading underscore, or a name-mangled ``__name``; not a
dunder) of a dependency is no interface: it changes in a patch release without a word. Every
module under agents/ and daemon/ is parsed, and each such access is allowed only when ``x`` is
ours for certain:

* ``self`` or ``cls``, in a class whose bases are all ours (or builtins); in a subclass of a
  dependency's class, only for the names the class itself defines (methods, ``self._x = ...``),
  since the others are the dependency's;
* a name bound at module level in the same file (a function, class, constant, or an import of
  one of our own packages, `denpex_agent` or `denpexd`);
* ``super()`` in a class whose bases are all ours (defined in the file or imported from our
  packages).

Anything else is flagged: a dependency's object (``client._client``, ``site._server``), a
dependency's module (``argparse._SubParsersAction``), ``super()._x`` in a subclass of a
dependency's class, or a local whose type the check cannot know. `DOCUMENTED` names the few
underscored names that are documented public API.
"""

from __future__ import annotations

import ast
import builtins
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("denpex_agent", "denpexd")
DOCUMENTED = frozenset({"os._exit"})  # documented: exit without cleanup (the watchdog, a forked child)


@dataclass(frozen=True)
class Access:
    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in OURS


def _module_names(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound at module level that are ours, and those bound to a foreign import (name →
    the imported module path, e.g. ``os`` → ``os``)."""
    ours: set[str] = set()
    foreign: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if _ours(alias.name):
                    ours.add(bound)
                else:
                    foreign[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.level == 0 and _ours(node.module):
                    ours.add(bound)
                else:
                    foreign[bound] = f"{node.module}.{alias.name}"
    for node in tree.body:  # definitions at module level
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            ours.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                ours.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return ours - set(foreign), foreign


_BY_NAME = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _attribute_access(node: ast.AST) -> ast.Attribute | None:
    """The attribute ``node`` reaches: ``x.name`` itself, or ``getattr(x, "name", ...)`` (and
    ``setattr``, ``hasattr``, ``delattr``) with the name spelled as a string, as ``x.name``."""
    if isinstance(node, ast.Attribute):
        return node
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _BY_NAME
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return ast.copy_location(
            ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Load()), node
        )
    return None


def private_accesses(source: str, file: str = "<snippet>") -> list[Access]:
    """Every access to a private attribute of an object that is not certainly ours."""
    tree = ast.parse(source)
    ours, foreign = _module_names(tree)
    found: list[Access] = []

    def base_is_ours(cls: ast.ClassDef) -> bool:
        return all(isinstance(b, ast.Name) and (b.id in ours or b.id in vars(builtins)) for b in cls.bases)

    def defined_in(cls: ast.ClassDef) -> set[str]:
        names: set[str] = set()
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)  # class-level assignments (and locals: a harmless superset)
        return names

    def visit(node: ast.AST, cls: ast.ClassDef | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node
        access = _attribute_access(node)
        if access is not None and _private(access.attr):
            base = access.value
            text = ast.unparse(access)
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                allowed = cls is None or base_is_ours(cls) or access.attr in defined_in(cls)
            elif isinstance(base, ast.Name):
                allowed = base.id in ours
                allowed = allowed or f"{foreign.get(base.id)}.{access.attr}" in DOCUMENTED
            elif isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                allowed = cls is not None and base_is_ours(cls)
            else:
                allowed = False
            if not allowed:
                found.append(Access(file, access.lineno, text))
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(tree, None)
    return found


def test_the_product_touches_no_private_attribute_of_a_dependency() -> None:
    found: list[Access] = []
    files = sorted([*(ROOT / "agents").rglob("*.py"), *(ROOT / "daemon").rglob("*.py")])
    assert len(files) > 40, "the source roots were found"
    for path in files:
        found += private_accesses(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "private attributes of others' objects:\n" + "\n".join(map(str, found))


def _flagged(snippet: str) -> list[str]:
    return [a.text for a in private_accesses(textwrap.dedent(snippet))]


def test_the_check_flags_a_dependencys_private_attributes() -> None:
    assert _flagged(
        """
        import aiomqtt
        from aiohttp import web
        import argparse

        async def main(site: web.TCPSite) -> None:
            client = aiomqtt.Client("localhost")
            client._client.loop_write()
            port = site._server.sockets[0]
            x = aiomqtt._internal
            sub: argparse._SubParsersAction
            self_like = client
            self_like.__mangled()
            queue = getattr(client, "_queue", None)
            hasattr(site, "_server")
            getattr(client, "messages")
        """
    ) == [
        "client._client",
        "site._server",
        "aiomqtt._internal",
        "argparse._SubParsersAction",
        "self_like.__mangled",
        "client._queue",
        "site._server",
    ]


def test_the_check_flags_super_into_a_dependencys_class_and_chains_through_self() -> None:
    assert _flagged(
        """
        import aiomqtt

        class Loop(aiomqtt.Client):
            def _on_disconnect(self, *args: object) -> None:
                super()._on_disconnect(*args)

            def poke(self) -> None:
                self._mine = 1
                self._client._sock_close()
                self._loop.call_soon(self._on_disconnect)
                self._mine += 1
        """
    ) == ["super()._on_disconnect", "self._client._sock_close", "self._client", "self._loop"]


def test_the_check_allows_what_is_ours() -> None:
    assert (
        _flagged(
            """
        import os
        from denpex_agent import wire

        _CACHE: dict[str, int] = {}

        class _Base:
            def _thin(self) -> None:
                self._items = []

        class Error(Exception):
            def __init__(self) -> None:
                self._why = ""

            def why(self) -> str:
                return self._why

        class Child(_Base):
            def _thin(self) -> None:
                super()._thin()
                cls = type(self)
                cls._helper = None

        def f() -> None:
            wire._EVENT_KEYS
            _CACHE.clear()
            Child._thin
            os._exit(1)
            x.__class__
        """
        )
        == []
    )
