"""The transport's options are declared and checked before DPDK loads, each refusal naming the key, the value
and what would do; nothing imports the C shim until the transport is built."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import erdma_core
from erdma_core import load_config
from erdma_core.sdk import ConfigError

from .conftest import needs_dpdk


def test_the_options_are_declared_with_their_defaults():
    section = load_config({"transport.name": "dpdk"}).section("transport.dpdk")
    assert (section["backend"], section["frame_bytes"], section["window"], section["peer_timeout"]) == \
        ("memif", 0, 256, 10.0)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("backend", "af_xdp", "valid choices: memif, af_packet"),
    ("window", 4, "below the minimum 8"),
    ("inject_loss", 0.9, "0.9"),
])
def test_bad_options_are_refused_naming_the_key(key, value, words):
    with pytest.raises(ConfigError) as err:
        load_config({"transport.name": "dpdk", f"transport.dpdk.{key}": value})
    assert f"transport.dpdk.{key}" in str(err.value) and words in str(err.value)


def _init(tmp_path: Path, **options: object) -> None:
    config = {"transport.name": "dpdk", "timeouts.connect": 5.0,
              **{f"transport.dpdk.{k}": v for k, v in options.items()}}
    pg = erdma_core.init(config, rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    pg.destroy()


@pytest.mark.parametrize(("options", "message"), [
    ({"memif_buffer_bytes": 2048}, "'transport.dpdk.memif_buffer_bytes': bsize 2048 < frame 9000"),
    ({"memif_buffer_bytes": 4000, "frame_bytes": 4096}, "bsize 4000 < frame 4096"),
    ({"interface": "eth0"}, "'transport.dpdk.interface': 'eth0' is for af_packet"),
    ({"backend": "af_packet"}, "'transport.dpdk.interface': backend af_packet needs a network interface (one of: "),
    ({"rto_min_us": 5000, "rto_max_us": 1000}, "'transport.dpdk.rto_max_us': 1000 is below rto_min_us (5000)"),
    ({"frame_bytes": 40}, "'transport.dpdk.frame_bytes': 40 leaves no room"),
])
def test_settings_dpdk_would_take_badly_are_refused_before_it_loads(tmp_path, options, message):
    with pytest.raises(ConfigError) as err:
        _init(tmp_path, **options)
    assert message in str(err.value)


@needs_dpdk
def test_an_interface_that_is_not_there_is_named_with_those_that_are(tmp_path):
    with pytest.raises(ConfigError) as err:
        _init(tmp_path, backend="af_packet", interface="nosuch{rank}")
    assert "'transport.dpdk.interface': 'nosuch0' is not a network interface here (have: " in str(err.value)
    assert "lo" in str(err.value)


def test_nothing_imports_the_shim_until_the_transport_is_built():
    code = ("import sys, erdma_dpdk.plugin, erdma_dpdk.doctor\n"
            "from erdma_core import load_config\n"
            "load_config({'transport.name': 'dpdk'})\n"
            "print(sorted(m for m in sys.modules if m.startswith('erdma_dpdk')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert "erdma_dpdk._shim" not in out and "erdma_dpdk.plugin" in out


def test_the_readme_config_block_loads(tmp_path):
    block = re.search(r"```toml\n(.*?)```", (Path(__file__).parents[1] / "README.md").read_text(), re.S)[1]
    (tmp_path / "erdma.toml").write_text(block)
    config = load_config(tmp_path / "erdma.toml")
    assert config["transport.name"] == "dpdk" and config.section("transport.dpdk")["backend"] == "memif"
