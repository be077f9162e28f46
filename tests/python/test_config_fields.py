"""MoE's keywords are the C++ layer's config fields (moe_echo/config_fields.hpp, exported as
moe_echo.moe_config_fields() and echo_config_fields()): MoE.__init__ takes them as **config, and
its signature (what inspect.signature, help() and IDEs show), defaults and order, and its
docstring's Args entries are made from the lists at import (moe_echo/torch/_keywords.py). These
tests hold them to the lists, pass every keyword through to the layer's config, refuse unknown
keywords and values of a field's wrong type or outside its names by the keyword's name, and show
that a field added to a list becomes a keyword with no other edit. docs/python.md's table is
checked against the lists: a field added fails test_docs_table_lists_every_keyword with the row
to add."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import moe_echo
from moe_echo import _ext
from moe_echo.torch import MoE
from moe_echo.torch import _keywords, module

ROOT = Path(__file__).resolve().parents[2]
# Keywords of MoE that no default could serve: the layer's shape (the lists' 0 is no shape); the
# first four are also positional.
REQUIRED = ("hidden", "ffn", "experts", "top_k", "max_tokens")
# MoE's keywords that are not config fields, after them, with their defaults.
OTHERS = {"device": None, "dtype": None, "seed": None, "ep_group": None, "ep_transport": "auto"}


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
    assert [p.name for p in params] == [p.name for p in inspect.signature(MoE).parameters.values()]
    got = [p.name for p in params]
    missing = []
    want = [k for k, _ in keyword_fields()] + list(OTHERS)
    for i, (keyword, f) in enumerate(keyword_fields()):
        if keyword not in got:
            after = want[i - 1] if i else "top_k"
            missing.append(f"{keyword}: {f['type']} = {f['default']!r}  (after {after})")
    assert not missing, "MoE.__init__ lacks the keywords:\n  " + "\n  ".join(missing)
    assert got == want, "MoE.__init__'s keywords are not in the lists' order"
    for p, (keyword, f) in zip(params, keyword_fields()):
        assert p.annotation == f["type"], f"{keyword}: annotation {p.annotation}, want {f['type']}"
        positional = keyword in REQUIRED[:4]
        assert p.kind == (inspect.Parameter.POSITIONAL_OR_KEYWORD if positional
                          else inspect.Parameter.KEYWORD_ONLY), keyword
        if keyword in REQUIRED:
            assert p.default is inspect.Parameter.empty, f"{keyword} has a default"
        else:
            assert p.default == f["default"] and type(p.default) is type(f["default"]), (
                f"{keyword} = {p.default!r}, the list's default is {f['default']!r}")
    for p in params[len(keyword_fields()):]:
        assert p.kind == inspect.Parameter.KEYWORD_ONLY and p.default == OTHERS[p.name], p


def another_value(f):
    """A value of field `f`'s type other than its default (a range may refuse it: the layer is
    not built on the meta device)."""
    if f["choices"]:
        return next(c for c in reversed(f["choices"]) if c != f["default"])
    return {"bool": lambda d: not d, "int": lambda d: d + 1, "float": lambda d: d + 0.5,
            "str": lambda d: d}[f["type"]](f["default"])


def test_every_keyword_reaches_the_config():
    shape = dict(hidden=16, ffn=16, experts=8, top_k=2, max_tokens=8)
    defaults = MoE(**shape, device="meta")
    for keyword, f in keyword_fields():
        config = defaults._config if f["name"] in defaults._config else defaults._echo_config
        value = shape.get(keyword, f["default"])
        assert config[f["name"]] == value and type(config[f["name"]]) is type(value), keyword
        if keyword in REQUIRED:
            continue
        value = another_value(f)
        m = MoE(**shape, **{keyword: value}, device="meta")
        config = m._config if f["name"] in m._config else m._echo_config
        assert config[f["name"]] == value, keyword


def test_an_unknown_keyword_is_refused_by_name():
    shape = dict(hidden=16, ffn=16, experts=8, top_k=2, max_tokens=8, device="meta")
    with pytest.raises(TypeError, match=r"^MoE.__init__\(\) got an unexpected keyword argument "
                                        r"'chunk'. Did you mean 'chunks'\?$"):
        MoE(**shape, chunk=2)
    with pytest.raises(TypeError, match="'sed'. Did you mean 'seed'"):
        MoE(**shape, sed=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        MoE(**shape, zzz=2)
    with pytest.raises(TypeError, match="'master_weights': the field is no keyword of MoE"):
        MoE(**shape, master_weights=True)
    with pytest.raises(TypeError, match="max_tokens"):
        MoE(16, 16, 8, 2)


def test_a_field_added_to_a_list_is_a_keyword(monkeypatch):
    # The lists as they would be with a field appended to MoeConfig's: the keyword is in the
    # signature (after capacity_factor, with its default), in the docstring and in the config.
    new = dict(name="new_knob", type="int", default=3, allowed="new_knob >= 0", choices=None,
               help="a field that the C++ lists do not have yet")
    fields = _ext.moe_config_fields() + [new]
    check = _ext.check_fields
    monkeypatch.setattr(_ext, "moe_config_fields", lambda: fields)
    monkeypatch.setattr(_ext, "check_fields", lambda moe, echo, keywords: check(
        {k: v for k, v in moe.items() if k != "new_knob"}, echo, keywords))
    monkeypatch.setattr(_keywords, "_KEYWORDS", None)
    sig = _keywords.signature(MoE.__init__)
    names = list(sig.parameters)
    assert names[names.index("capacity_factor") + 1] == "new_knob"
    assert sig.parameters["new_knob"].default == 3
    assert "new_knob (int, default 3): a field that" in _keywords.document(_keywords.MARKER)
    m = MoE(16, 16, 8, 2, max_tokens=8, device="meta", new_knob=5)
    assert m._config["new_knob"] == 5
    assert MoE(16, 16, 8, 2, max_tokens=8, device="meta")._config["new_knob"] == 3


def documented(text: str) -> dict[str, str]:
    """The entries of an Args section ("        a, b (type, default x): ..." and the lines
    indented under it), by name, in order."""
    entries, names = {}, []
    for line in text.splitlines():
        m = re.match(r"^        ([a-z_0-9]+(?:, [a-z_0-9]+)*)( \(.*?\))?: ", line)
        if m:
            names = m.group(1).split(", ")
            for n in names:
                entries[n] = line.strip()
        elif line.startswith(" " * 12) and names:
            for n in names:
                entries[n] += " " + line.strip()
        else:
            names = []
    return entries


def test_docstring_is_the_lists():
    want = [k for k, _ in keyword_fields()] + list(OTHERS)
    got = documented(MoE.__doc__)
    missing = [k for k in want if k not in got]
    assert not missing, f"MoE's docstring does not document {missing}"
    assert list(got) == want, "MoE's docstring documents the keywords in another order"
    for keyword, f in keyword_fields():
        default = "" if keyword in REQUIRED else f", default {f['default']!r}"
        entry = got[keyword]
        assert entry.startswith(f"{keyword} ({f['type']}{default}): "), entry
        assert " ".join(f["help"].split()) in entry and f["allowed"] in entry, entry
    assert "<config fields>" not in MoE.__doc__


def test_docs_table_lists_every_keyword():
    text = (ROOT / "docs/python.md").read_text()
    table = text[text.index("## The module"):]
    table = table[:table.index("\n\n", table.index("| argument"))]
    rows = [f"| `{k}` | {f['help']} |" for k, f in keyword_fields() if f"`{k}`" not in table]
    assert not rows, ("docs/python.md's table of MoE's arguments lacks a row of each of these "
                      "fields (reword as fits):\n" + "\n".join(rows))


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


def test_clone_cost_defaults_to_the_cost_models_price_on_cuda():
    """ECHO's clone cost when not given: the cost model's price of one clone on CUDA (as
    `moe-echo bench` on a GPU), fp32 gradients dearer than bf16 ones; free clones on the CPU; a
    value given is kept."""
    from moe_echo.torch.module import default_clone_cost_rows

    # 18HF bytes (bf16 weights in, fp32 gradient out) at 310 GB/s over 18HF FLOPs at 690 TFLOP/s.
    assert _ext.default_clone_cost_rows(7168, 2048, 4) == 2226
    assert _ext.default_clone_cost_rows(7168, 2048, 2) == 1484  # 12HF bytes
    cuda = torch.device("cuda")
    assert default_clone_cost_rows(cuda, torch.float32, 7168, 2048) == 2226
    assert default_clone_cost_rows(cuda, torch.bfloat16, 7168, 2048) == 1484
    assert default_clone_cost_rows(torch.device("cpu"), torch.float32, 7168, 2048) == 0
    assert MoE(64, 32, 8, 2, max_tokens=16)._echo_config["clone_cost_rows"] == 0
    assert MoE(64, 32, 8, 2, max_tokens=16, clone_cost_rows=7)._echo_config["clone_cost_rows"] == 7
    with pytest.raises(ValueError, match="grad_bytes = 3 is invalid"):
        _ext.default_clone_cost_rows(64, 32, 3)
    with pytest.raises(ValueError, match="hidden, ffn = 0, 32 is invalid"):
        _ext.default_clone_cost_rows(0, 32, 4)
