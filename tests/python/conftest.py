import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # reference.py

import pytest  # noqa: E402


@pytest.fixture
def layer_builds(monkeypatch):
    """The C++ layers built while the test runs, in order: True for one built on a workspace,
    False for one with buffers of its own."""
    import moe_echo

    built = []
    layer = moe_echo._ext.Layer

    def counting_layer(*args, **kw):
        built.append("workspace" in kw)
        return layer(*args, **kw)

    monkeypatch.setattr(moe_echo._ext, "Layer", counting_layer)
    return built
