"""MoE's keywords are the C++ layer's config fields (moe_echo/config_fields.hpp, exported as
moe_echo.moe_config_fields() and echo_config_fields()): the signature, its defaults and order, the
docstring and docs/python.md's table follow the lists, and a value of a field's wrong type or
outside its names is refused by the keyword's name. A field added to a list fails these tests
with the line to add until the module takes it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import moe_echo
from moe_echo.torch import MoE
from moe_echo.torch import module

ROOT = Path(__file__).resolve().parents[2]
# Keywords of MoE that no default could serve: the layer's shape (the lists' 0 is no shape).
REQUIRED = ("hidden", "ffn", "experts", "top_k", "max_tokens")
# MoE's keywords that are not config fields, after them.
OTHERS = ["device", "dtype", "seed", "ep_group", "ep_transport"]


def keyword_fields():
    """(keyword, field) of each field MoE takes, in the lists' order."""
    out = [(f["name"], f) for f in moe_echo.moe_config_fields()
           if f["name"] not in module._NOT_KEYWORDS]
    out += [(module._ECHO_KEYWORDS.get(f["name"], f["name"]), f)
            for f in moe_echo.echo_config_fields()]
    return out


def test_the_lists_are_exported():
    fields = moe_echo.moe_config_fields()
    names = [f["name"] for f in fields]
    assert names[:5] == ["hidden", "ffn", "experts", "top_k", "max_tokens"]
    assert "capacity_factor" in names
    assert "capacity_factor" not in [f["name"] for f in moe_echo.echo_config_fields()]
    for f in fields + moe_echo.echo_config_fields():
        assert set(f) == {"name", "type", "default", "allowed", "choices", "help"}
        assert type(f["default"]).__name__ == f["type"], f
        assert f["help"] and f["allowed"]
        if f["choices"]:
            assert f["default"] in f["choices"]
    chunks = next(f for f in fields if f["name"] == "chunks")
    assert (chunks["type"], chunks["default"], chunks["allowed"]) == ("int", 1, "1 <= chunks <= 16")
    # The module's exceptions name fields there are.
    assert set(module._NOT_KEYWORDS) <= set(names)
    assert set(module._ECHO_KEYWORDS) <= {f["name"] for f in moe_echo.echo_config_fields()}


def test_signature_is_the_lists():
    params = list(inspect.signature(MoE.__init__).parameters.values())[1:]
    got = [p.name for p in params]
    want = [k for k, _ in keyword_fields()] + OTHERS
    missing = []
    for i, (keyword, f) in enumerate(keyword_fields()):
        if keyword not in got:
            after = want[i - 1] if i else "top_k"
            missing.append(f"{keyword}: {f['type']} = {f['default']!r}  (after {after})")
    assert not missing, "MoE.__init__ lacks the keywords:\n  " + "\n  ".join(missing)
    assert got == want, "MoE.__init__'s keywords are not in the lists' order"
    for p, (keyword, f) in zip(params, keyword_fields()):
        assert p.annotation == f["type"], f"{keyword}: annotation {p.annotation}, want {f['type']}"
        if keyword in REQUIRED:
            assert p.default is inspect.Parameter.empty, f"{keyword} has a default"
        else:
            assert p.default == f["default"] and type(p.default) is type(f["default"]), (
                f"{keyword} = {p.default!r}, the list's default is {f['default']!r}")


def documented(text: str) -> list[str]:
    """The names of an Args section's entries ("        a, b: ..." lines), in order."""
    names = []
    for line in text.splitlines():
        m = re.match(r"^        ([a-z_0-9]+(?:, [a-z_0-9]+)*): ", line)
        if m:
            names += m.group(1).split(", ")
    return names


def test_docstring_is_the_lists():
    want = [k for k, _ in keyword_fields()] + OTHERS
    got = documented(MoE.__doc__)
    missing = [k for k in want if k not in got]
    assert not missing, f"MoE's docstring does not document {missing}"
    assert got == want, "MoE's docstring documents the keywords in another order than the lists'"


def test_docs_table_lists_every_keyword():
    text = (ROOT / "docs/python.md").read_text()
    table = text[text.index("## The module"):]
    table = table[:table.index("\n\n", table.index("| argument"))]
    missing = [k for k, _ in keyword_fields() if f"`{k}`" not in table]
    assert not missing, f"docs/python.md's table of MoE's arguments lacks {missing}"


# A value of each field's wrong type, and a name outside a field's choices.
WRONG_TYPE = {"int": "1", "float": "x", "bool": "yes", "str": 3}


@pytest.mark.parametrize("keyword,field", keyword_fields(), ids=[k for k, _ in keyword_fields()])
def test_a_bad_value_is_refused_by_name(keyword, field):
    shape = dict(hidden=16, ffn=16, experts=8, top_k=2, max_tokens=8)
    with pytest.raises(TypeError, match=f"^{keyword} = "):
        MoE(**{**shape, keyword: WRONG_TYPE[field["type"]]}, device="meta")
    if field["choices"]:
        with pytest.raises(ValueError, match=f"^{keyword} = 'nope' is invalid: allowed '"):
            MoE(**{**shape, keyword: "nope"}, device="meta")


def test_a_value_outside_its_range_is_refused_by_name():
    shape = dict(hidden=16, ffn=16, experts=8, top_k=2, max_tokens=8, dtype=torch.float64)
    for keyword, value in (("chunks", 0), ("in_flight", 17), ("overlap_sms", -1),
                           ("capacity_factor", 0.0), ("bias_update_rate", -1.0),
                           ("spare_slots_per_rank", -1), ("clone_cost_rows", -1)):
        with pytest.raises(ValueError, match=f"^{keyword} = "):
            MoE(**{**shape, keyword: value})
