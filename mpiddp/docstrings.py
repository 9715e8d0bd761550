"""Docstring text that many public calls share, written once.

A docstring names a shared snippet on a line of its own, in braces::

    Raises:
        {needs_init}

``shared_doc`` replaces every such line with the snippet, indented as the line was (the
snippet's own lines keep their relative indentation), so ``help()``, IDEs and
``tests/test_api.py`` see the whole text. Snippets may hold ``$name`` placeholders, filled
from the keyword arguments of ``shared_doc`` (``$kind``: the collective's kind in generated
names). A line that names an unknown snippet is an error at import time, never a silent gap.
"""
from __future__ import annotations

import re
from string import Template
from typing import Callable, Mapping, TypeVar

F = TypeVar("F", bound=Callable)

_SNIPPET_LINE = re.compile(r"^(?P<indent>[ \t]*)\{(?P<name>[a-z_0-9]+)\}[ \t]*$", re.M)

# Shared by the runtime's calls and every call that needs a running engine.
RUNTIME_SNIPPETS = {
    "needs_init": """\
NotInitializedError: before ``init()``.
EngineShutdownError: after ``shutdown()``.""",
}


def expand(doc: str, snippets: Mapping[str, str], **params: object) -> str:
    """``doc`` with every ``{name}`` line replaced by ``snippets[name]`` (see the module
    docstring). Raises KeyError naming a snippet that does not exist."""
    values = {key: str(value) for key, value in params.items()}

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in snippets:
            raise KeyError(f"docstring names the unknown shared snippet {{{name}}}")
        text = Template(snippets[name]).substitute(values)
        indent = match.group("indent")
        return "\n".join(indent + line if line else line for line in text.splitlines())

    return _SNIPPET_LINE.sub(replace, doc)


def shared_doc(snippets: Mapping[str, str] = RUNTIME_SNIPPETS, **params: object
               ) -> Callable[[F], F]:
    """Decorator: expand the function's docstring from ``snippets`` (``expand``)."""
    def decorate(function: F) -> F:
        function.__doc__ = expand(function.__doc__ or "", snippets, **params)
        return function
    return decorate
