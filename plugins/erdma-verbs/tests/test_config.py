"""On the host: selecting the verbs transport, which this version does not register yet, is refused with
what is missing (not with advice to install what is installed)."""

from __future__ import annotations

import pytest

from erdma_core import load_config
from erdma_core.errors import ConfigError


def test_the_verbs_transport_is_refused_until_it_is_built():
    with pytest.raises(ConfigError) as err:
        load_config({"transport.name": "verbs"})
    assert "config key 'transport.name': invalid value 'verbs'" in str(err.value)
    assert "erdma-verbs 0.1.0 is installed but does not provide transport 'verbs' yet" in str(err.value)


def test_nothing_imports_pyverbs_on_the_host():
    import sys

    import erdma_verbs.guest  # noqa: F401

    assert "pyverbs" not in sys.modules
