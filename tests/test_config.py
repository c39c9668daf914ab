"""The config pipeline: defaults < erdma.toml < ERDMA_* environment < arguments, every error naming
the key, the value and the valid choices."""

from __future__ import annotations

import subprocess
import sys

import pytest

from erdma_core import ConfigError, load_config
from erdma_core.config import env_name


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    import os

    for var in [v for v in os.environ if v.startswith("ERDMA_") and v != "ERDMA_DISABLE_PLUGINS"]:  # see conftest
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


def write(tmp_path, text):
    path = tmp_path / "erdma.toml"
    path.write_text(text)
    return path


def test_embedded_defaults():
    conf = load_config()
    assert conf["transport.name"] == "tcp" and conf.sources["transport.name"] == "default"
    assert conf["timeouts.collective"] == 300.0 and conf["transport.tcp.nodelay"] is True


def test_file_then_env_then_argument(tmp_path, monkeypatch):
    path = write(tmp_path, '[collectives]\nallreduce = "ring"\nchunk_bytes = 8192\n'
                           '[transport.tcp]\nnodelay = false\n[timeouts]\ncollective = 30\n')
    monkeypatch.setenv("ERDMA_TIMEOUT", "12.5")
    monkeypatch.setenv("ERDMA_COLLECTIVES_CHUNK_BYTES", "16384")
    conf = load_config(path, **{"collectives.allreduce": "tree"})
    assert conf["transport.tcp.nodelay"] is False and conf.sources["transport.tcp.nodelay"] == f"file {path}"
    assert conf["timeouts.collective"] == 12.5 and conf.sources["timeouts.collective"] == "env ERDMA_TIMEOUT"
    assert conf["collectives.chunk_bytes"] == 16384
    assert conf["collectives.allreduce"] == "tree" and conf.sources["collectives.allreduce"] == "argument"


def test_an_empty_environment_value_is_unset(tmp_path, monkeypatch):
    """``ERDMA_COMPRESSION_NAME= cmd`` is as if the variable were not there: the file's value (or the default)
    holds, and an empty variable of no known name is no error (a shell's way to unset it for one command)."""
    path = write(tmp_path, '[collectives]\nallreduce = "ring"\n')
    for var in ("ERDMA_COMPRESSION_NAME", "ERDMA_COLLECTIVES_ALLREDUCE", "ERDMA_TIMEOUT", "ERDMA_NO_SUCH_KEY"):
        monkeypatch.setenv(var, "")
    conf = load_config(path)
    assert conf["collectives.allreduce"] == "ring" and conf.sources["collectives.allreduce"] == f"file {path}"
    assert conf.sources["timeouts.collective"] == "default"
    assert conf["compression.name"] == "none" and conf.sources["compression.name"] == "default"


def test_erdma_toml_in_cwd_and_erdma_config(tmp_path, monkeypatch):
    write(tmp_path, '[collectives]\nalltoall = "sequential"\n')
    assert load_config()["collectives.alltoall"] == "sequential"
    other = tmp_path / "other.toml"
    other.write_text('[transport]\nname = "tcp"\n[collectives]\nalltoall = "pairwise"\n')
    monkeypatch.setenv("ERDMA_CONFIG", str(other))
    assert load_config()["collectives.alltoall"] == "pairwise"
    monkeypatch.setenv("ERDMA_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=r"missing\.toml' does not exist"):
        load_config()


def test_every_key_has_a_unique_env_name():
    conf = load_config()
    names = [env_name(k) for k, _, _ in conf.items()]
    assert len(names) == len(set(names))
    assert env_name("transport.tcp.socket_buffer_bytes") == "ERDMA_TRANSPORT_TCP_SOCKET_BUFFER_BYTES"


@pytest.mark.parametrize("var,value,key,expected", [
    ("ERDMA_TRANSPORT", "tcp", "transport.name", "tcp"),
    ("ERDMA_ALGORITHM", "halving_doubling", "collectives.allreduce", "halving_doubling"),
    ("ERDMA_COMPRESSION", "none", "compression.name", "none"),
    ("ERDMA_TIMEOUT", "7", "timeouts.collective", 7.0),
    ("ERDMA_TRANSPORT_TCP_KEEPALIVE", "off", "transport.tcp.keepalive", False),
    ("ERDMA_SECURITY_SECRET", "s3cret", "security.secret", "s3cret"),
    ("ERDMA_SECRET", "s3cret", "security.secret", "s3cret"),
])
def test_env_overrides(monkeypatch, var, value, key, expected):
    monkeypatch.setenv(var, value)
    conf = load_config()
    assert conf[key] == expected and conf.sources[key] == f"env {var}"


@pytest.mark.parametrize("toml,message", [
    ('[transport]\nnmae = "tcp"\n',
     "unknown key 'transport.nmae' in [transport]; valid keys: fallback, name (did you mean 'name'?)"),
    ('[transprot]\nname = "tcp"\n', "unknown section [transprot]; valid sections:"),
    ('[timeouts]\ncollective = "soon"\n', "config key 'timeouts.collective': value 'soon' is a str, expected float"),
    ('[timeouts]\ncollective = -1\n', "config key 'timeouts.collective': value -1.0 is below the minimum 0.001"),
    ('[collectives]\nallreduce = "rnig"\n', "config key 'collectives.allreduce': invalid value 'rnig'; valid "
                                             "choices: auto, halving_doubling, parameter_server, recursive_doubling, "
                                             "ring, tree (did you mean 'ring'?)"),
    ('[transport]\nname = "quik"\n', "config key 'transport.name': invalid value 'quik'; valid choices: tcp; "),
    ('[transport.tcp]\nnodelay = "yes"\n', "config key 'transport.tcp.nodelay': value 'yes' is a str, expected bool"),
    ("[transport\n", "is not valid TOML"),
])
def test_bad_file_values(tmp_path, toml, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, toml))
    assert message in str(info.value)


def _left_out(dist: str, plugin: str, kind: str = "transport", name: str | None = None) -> str:
    """What an unknown name provided by ``dist`` is told: that no installed plugin provides it, or (installed,
    and left out here by the conftest's ERDMA_DISABLE_PLUGINS) which plugin does and that it is left out."""
    import importlib.metadata

    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return (f"no installed plugin provides {kind} {name or plugin!r} (eRDMA's plugins are distributions of their "
                "own: README.md, \"Plugins\", lists what each provides)")
    return f"plugin {plugin!r} ({dist} {version}) provides it, but is left out by ERDMA_PLUGINS/ERDMA_DISABLE_PLUGINS"


def test_a_misspelt_plugin_component_is_told_the_plugin_that_provides_the_name_it_resembles(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, '[transport]\nname = "quik"\n'))
    said = _left_out("erdma-quic", "quic", name="quik")
    assert (said if said.startswith("no installed") else f"did you mean 'quic'? {said}") in str(info.value)


@pytest.mark.parametrize("var,value,message", [
    ("ERDMA_TIMEOUT", "abc", "config key 'timeouts.collective': value 'abc' is not a valid float"),
    ("ERDMA_TRANSPORT_TCP_NODELAY", "maybe", "value 'maybe' is not a boolean; valid: true, false, 1, 0"),
    ("ERDMA_TRANSPORT", "dpdk", "valid choices: tcp; " + _left_out("erdma-dpdk", "dpdk")),
    ("ERDMA_TIMEOUT", "nan", "config key 'timeouts.collective': value nan is not a finite number"),
    ("ERDMA_TIMEOUTS_CONNECT", "inf", "config key 'timeouts.connect': value inf is not a finite number"),
    ("ERDMA_TIMEOUT", "1e300", "config key 'timeouts.collective': value 1e+300 is above the maximum 604800.0"),
    ("ERDMA_TRANSPORT_TCP_PORT", "70000", "config key 'transport.tcp.port': value 70000 is above the maximum 65535"),
    ("ERDMA_TRANSPORT_TCP_SOCKET_BUFFER_BYTES", "99999999999",
     "config key 'transport.tcp.socket_buffer_bytes': value 99999999999 is above the maximum 1073741824"),
    ("ERDMA_TRANSPROT", "tcp", "environment variable ERDMA_TRANSPROT='tcp' is not a config key and no installed "
                               "plugin declares it; config keys follow ERDMA_<SECTION>_<KEY> (did you mean "
                               "'ERDMA_TRANSPORT'?)"),
])
def test_bad_env_values(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_config()
    assert message in str(info.value)


def test_unknown_argument_key():
    with pytest.raises(ConfigError) as info:
        load_config({"collectives.allreduse": "ring"})
    assert str(info.value) == "unknown config key 'collectives.allreduse' (did you mean 'collectives.allreduce'?)"


def test_config_show_prints_values_and_sources(tmp_path):
    path = write(tmp_path, '[collectives]\nallreduce = "ring"\n')
    env = {"PATH": "/usr/bin:/bin", "ERDMA_TIMEOUT": "9"}
    out = subprocess.run([sys.executable, "-m", "erdma_core.cli", "config", "show", "--config", str(path)],
                         capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    lines = {line.split("=")[0].strip(): line for line in out.splitlines()}
    assert "'ring'" in lines["collectives.allreduce"] and f"# file {path}" in lines["collectives.allreduce"]
    assert "9.0" in lines["timeouts.collective"] and "# env ERDMA_TIMEOUT" in lines["timeouts.collective"]
    assert "# default" in lines["transport.name"]


def test_plugins_declare_the_environment_variables_they_own(install_plugin, monkeypatch):
    """Before: ERDMA_KEYS_DIR (erdma-quic's) made every init() and `erdma config show` fail."""
    monkeypatch.setenv("ERDMA_TESTENV_DIR", "/tmp/x")
    with pytest.raises(ConfigError) as info:
        load_config()
    assert "environment variable ERDMA_TESTENV_DIR='/tmp/x' is not a config key and no installed plugin declares " \
           "it" in str(info.value)
    install_plugin("testenv", "testenv")
    assert load_config()["transport.name"] == "tcp"
    monkeypatch.setenv("ERDMA_TESTENV_DIRR", "/tmp/x")
    with pytest.raises(ConfigError, match=r"ERDMA_TESTENV_DIRR='/tmp/x' is not a config key.*did you mean "
                                          r"'ERDMA_TESTENV_DIR'"):
        load_config()


def test_long_name_wins_over_shorthand_and_a_conflict_warns(monkeypatch):
    from erdma_core.config.load import ConfigWarning

    monkeypatch.setenv("ERDMA_TIMEOUT", "5")
    monkeypatch.setenv("ERDMA_TIMEOUTS_COLLECTIVE", "7")
    monkeypatch.setenv("ERDMA_DISCOVERY_INIT_METHOD", "file:///tmp/a")  # sorts before its shorthand
    monkeypatch.setenv("ERDMA_INIT_METHOD", "file:///tmp/b")
    with pytest.warns(ConfigWarning) as warned:
        conf = load_config()
    assert conf["timeouts.collective"] == 7.0 and conf.sources["timeouts.collective"] == "env ERDMA_TIMEOUTS_COLLECTIVE"
    assert conf["discovery.init_method"] == "file:///tmp/a"
    assert sorted(str(w.message) for w in warned) == [
        "ERDMA_INIT_METHOD='file:///tmp/b' and ERDMA_DISCOVERY_INIT_METHOD='file:///tmp/a' both set "
        "'discovery.init_method'; the long name wins",
        "ERDMA_TIMEOUT='5' and ERDMA_TIMEOUTS_COLLECTIVE='7' both set 'timeouts.collective'; the long name wins"]
    monkeypatch.setenv("ERDMA_TIMEOUT", "7")  # the same value: nothing to warn about
    monkeypatch.delenv("ERDMA_INIT_METHOD")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config()


def test_bad_values_name_where_they_came_from(tmp_path, monkeypatch):
    path = write(tmp_path, '[timeouts]\ncollective = -1\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {str(path)!r}: config key 'timeouts.collective': value -1.0 is below " \
                              "the minimum 0.001"
    path.unlink()
    monkeypatch.setenv("ERDMA_TRANSPORT_TCP_PORT", "-3")
    with pytest.raises(ConfigError) as info:
        load_config()
    assert str(info.value).startswith("environment variable ERDMA_TRANSPORT_TCP_PORT: config key "
                                      "'transport.tcp.port': value -3 is below the minimum 0")


@pytest.mark.parametrize("value,message", [
    ("999.1.1.1", "config key 'transport.tcp.bind_address': value '999.1.1.1' does not resolve to an IPv4 address"),
    ("192.0.2.7", "config key 'transport.tcp.bind_address': value '192.0.2.7' (192.0.2.7) is not an address of this "
                  "host (Cannot assign requested address)"),
])
def test_a_bind_address_must_resolve_to_an_address_of_this_host(value, message):
    from erdma_core.net.addresses import choose

    with pytest.raises(ConfigError) as info:
        choose(value, "", None)
    assert str(info.value).startswith(message)
    assert choose("127.0.0.1", "", None) == ("127.0.0.1", "127.0.0.1")
