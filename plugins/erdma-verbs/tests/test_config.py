"""On the host (no RDMA device here): the transport's options are declared and checked, choosing it where its C
side does not import says what to install, choosing it on a host without a device says so, and nothing loads
libibverbs until then."""

from __future__ import annotations

import subprocess
import sys

import pytest

import erdma_core
from erdma_core import load_config
from erdma_core.sdk import ConfigError, PluginError


def test_the_options_are_declared_with_their_defaults():
    section = load_config({"transport.name": "verbs"}).section("transport.verbs")
    assert (section["slots"], section["slot_bytes"], section["completion"], section["retry_count"]) == \
        (16, 256 << 10, "poll", 6)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("completion", "busy", "valid choices: poll, channel"),
    ("retry_count", 7, "7"),
    ("slots", 1, "1"),
    ("native_reduce_bytes", -1, "-1"),
])
def test_bad_options_are_refused_naming_the_key(key, value, words):
    with pytest.raises(ConfigError) as err:
        load_config({"transport.name": "verbs", f"transport.verbs.{key}": value})
    assert f"transport.verbs.{key}" in str(err.value) and words in str(err.value)


def test_choosing_verbs_without_its_c_side_says_what_to_install(tmp_path, monkeypatch):
    for name in ("erdma_verbs.transport", "erdma_verbs.rc"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "erdma_verbs._ibv", None)  # as where it was not built: ImportError
    with pytest.raises(PluginError) as err:
        erdma_core.init({"transport.name": "verbs", "timeouts.connect": 5.0}, rank=0, world_size=1,
                        init_method=f"file://{tmp_path}/store")
    assert "needs its C side over libibverbs" in str(err.value) and "apt-get install libibverbs-dev" in str(err.value)


@pytest.mark.skipif(__import__("importlib").util.find_spec("erdma_verbs._ibv") is None,
                    reason="erdma-verbs was installed without its C side (no libibverbs-dev)")
def test_choosing_verbs_on_a_host_without_a_device_says_so(tmp_path):
    from erdma_verbs import rc

    if rc.device_names():
        pytest.skip(f"this host has RDMA devices: {rc.device_names()}")
    with pytest.raises(rc.VerbsError, match=r"transport 'verbs': this host has no RDMA device \(the kernel has no RDMA "
                                            r"support, or no device is set up"):
        erdma_core.init({"transport.name": "verbs", "timeouts.connect": 5.0}, rank=0, world_size=1,
                        init_method=f"file://{tmp_path}/store")


def test_nothing_loads_libibverbs_until_the_transport_is_built():
    code = ("import sys, erdma_verbs.guest, erdma_verbs.plugin, erdma_core; erdma_core.load_config({'transport.name': "
            "'verbs'}); print(sorted({'erdma_verbs._ibv', 'erdma_verbs.rc', 'pyverbs'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out


def test_a_zero_copy_threshold_that_does_not_fit_a_slot_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"'transport.verbs.zero_copy_bytes': 8192 plus the 64-byte header must fit "
                                          r"in transport.verbs.slot_bytes \(8192\)"):
        erdma_core.init({"transport.name": "verbs", "transport.verbs.slot_bytes": 8192,
                         "transport.verbs.zero_copy_bytes": 8192}, rank=0, world_size=1,
                        init_method=f"file://{tmp_path}/store")


def test_the_header_size_the_plugin_assumes_is_the_cores():
    from erdma_verbs.plugin import HEADER_BYTES

    from erdma_core.toolkit import FRAME

    assert FRAME.size == HEADER_BYTES


def test_the_readme_config_block_loads(tmp_path):
    import re
    from pathlib import Path

    block = re.search(r"```toml\n(.*?)```", (Path(__file__).parents[1] / "README.md").read_text(), re.S)[1]
    (tmp_path / "erdma.toml").write_text(block)
    config = load_config(tmp_path / "erdma.toml")
    assert config["transport.name"] == "verbs" and config.section("transport.verbs")["device"] == "mlx5_0"
