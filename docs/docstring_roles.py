"""A Griffe extension for the API reference: the package's docstrings cite names with Sphinx roles
(:func:`~pkg.name`), which Markdown shows verbatim; this turns each into inline code of the name as written
(``name`` for a ``~`` path, the whole path otherwise)."""

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    name = match[2].rsplit(".", 1)[-1] if match[1] else match[2]
    return f"`{name}`"


class DocstringRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every loaded docstring as inline code."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
