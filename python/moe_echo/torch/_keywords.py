"""MoE's keywords, made from the C++ layer's config fields (moe_echo/config_fields.hpp, exported
as ``moe_echo.moe_config_fields()`` and ``echo_config_fields()``): the keyword of each field, its
default, the check of the keywords a call gives, the signature that ``inspect.signature``,
``help()`` and IDEs show, and the Args entries of the docstring. A field added to a list is a
keyword of ``MoE`` with nothing written here.

``MoE.__init__`` itself takes the layer's shape by name and the other fields as ``**config``;
``signature()`` gives it the signature of the lists (tests/python/test_config_fields.py holds it
to them).
"""

from __future__ import annotations

import difflib
import inspect
import textwrap
from typing import NamedTuple

from moe_echo import _ext

# Two EchoConfig fields take another keyword here:
ECHO_KEYWORDS = {"enabled": "echo", "placement": "echo_placement"}
# and one MoeConfig field is not a keyword, with the reason:
NOT_KEYWORDS = {
    "master_weights": "float masters for the layer's own AdamW; the module's parameters are "
    "stepped by a torch optimizer, which keeps them in the parameters' dtype",
}
# Keywords that no default could serve: the layer's shape (the lists' 0 is no shape). The first
# four are also positional.
POSITIONAL = ("hidden", "ffn", "experts", "top_k")
REQUIRED = POSITIONAL + ("max_tokens",)


class Keyword(NamedTuple):
    """A keyword of MoE and its config field (a dict of moe_config_fields() or
    echo_config_fields(); `config` says which: "moe" or "echo")."""

    name: str
    field: dict
    config: str

    @property
    def required(self) -> bool:
        return self.name in REQUIRED

    @property
    def default(self):
        return inspect.Parameter.empty if self.required else self.field["default"]


_KEYWORDS: list[Keyword] | None = None


def keywords() -> list[Keyword]:
    """The keywords of the config fields, in the lists' order (MoeConfig's, then EchoConfig's)."""
    global _KEYWORDS
    if _KEYWORDS is None:
        out = [Keyword(f["name"], f, "moe") for f in _ext.moe_config_fields()
               if f["name"] not in NOT_KEYWORDS]
        out += [Keyword(ECHO_KEYWORDS.get(f["name"], f["name"]), f, "echo")
                for f in _ext.echo_config_fields()]
        shape = [k.name for k in out[:len(REQUIRED)]]
        assert shape == list(REQUIRED), f"the lists open with the shape {REQUIRED}, not {shape}"
        _KEYWORDS = out
    return _KEYWORDS


def values(shape: dict, config: dict, others: tuple[str, ...] = ()) -> dict:
    """Every keyword's value: `shape` (the required keywords, given), `config` (the other
    keywords given), the lists' defaults for the rest. A name that is no keyword raises
    TypeError naming it, with the keywords close to it (`others`: MoE's keywords that are no
    field, also offered)."""
    known = {k.name: k for k in keywords()}
    for name in config:
        if name in known:
            continue
        if name in NOT_KEYWORDS:
            raise TypeError(f"MoE.__init__() got an unexpected keyword argument {name!r}: the "
                            f"field is no keyword of MoE ({NOT_KEYWORDS[name]})")
        close = difflib.get_close_matches(name, [*known, *others], n=3)
        hint = f". Did you mean {_or([repr(c) for c in close])}?" if close else ""
        raise TypeError(f"MoE.__init__() got an unexpected keyword argument {name!r}{hint}")
    out = {k.name: k.field["default"] for k in keywords() if not k.required}
    out.update(shape)
    out.update(config)
    return out


def signature(init) -> inspect.Signature:
    """The signature of MoE.__init__ (`init`, which takes ``**config``) with one keyword per
    field in its place: self and the positional shape, then keyword-only max_tokens and every
    other field with its type and the list's default, then init's own keywords (device, ...)."""
    own = inspect.signature(init).parameters
    kind = inspect.Parameter
    params = [own["self"]]
    for k in keywords():
        params.append(kind(k.name, kind.POSITIONAL_OR_KEYWORD if k.name in POSITIONAL
                           else kind.KEYWORD_ONLY, default=k.default,
                           annotation=k.field["type"]))
    taken = {p.name for p in params}
    params += [p for p in own.values() if p.name not in taken and p.kind is kind.KEYWORD_ONLY]
    return inspect.Signature(params)


# The docstring's line where the fields' Args entries go.
MARKER = "        <config fields>\n"


def document(doc: str) -> str:
    """`doc` with MARKER replaced by one Args entry per field: ``name (type, default): help;
    allowed: ...``, wrapped to 100 columns."""
    entries = []
    for k in keywords():
        f = k.field
        default = "" if k.required else f", default {f['default']!r}"
        head = f"{k.name} ({f['type']}{default}): "
        text = f"{head}{f['help']}; allowed: {f['allowed']}."
        if k.name != f["name"]:
            text += f" (EchoConfig's {f['name']})"
        entries.append(textwrap.fill(text, width=100, initial_indent=" " * 8,
                                     subsequent_indent=" " * 12, break_on_hyphens=False))
    assert doc.count(MARKER) == 1, "the docstring has one place for the fields"
    return doc.replace(MARKER, "\n".join(entries) + "\n")


def _or(words: list[str]) -> str:
    """ "a", "a or b", "a, b or c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
