"""erdma-quic's settings that cannot take effect are refused when the config is loaded (on every rank, before
it contacts anyone), naming the key, the value and what is valid."""

from __future__ import annotations

import pytest
from erdma_quic.ngtcp2.connection import loaded

from erdma_core import ConfigError, load_config

QUIC = {"transport.name": "quic", "security.secret": "s"}


@pytest.mark.parametrize("size", [5, 1199])
def test_a_datagram_size_quic_cannot_send_is_refused_at_load(size):
    with pytest.raises(ConfigError) as err:
        load_config({**QUIC, "transport.quic.datagram_size": size})
    assert f"config key 'transport.quic.datagram_size': value {size} is not valid" in str(err.value)
    assert "valid: 0 (the path MTU less IP and UDP headers) or 1200.." in str(err.value)


def test_each_engine_has_its_own_largest_datagram():
    with pytest.raises(ConfigError, match=r"1200\.\.16000"):
        load_config({**QUIC, "transport.quic.engine": "aioquic", "transport.quic.datagram_size": 16001})
    with pytest.raises(ConfigError, match=r"value 65528 is above the maximum 65527"):
        load_config({**QUIC, "transport.quic.datagram_size": 65528})
    if loaded() is not None:
        assert load_config({**QUIC, "transport.quic.engine": "ngtcp2",
                            "transport.quic.datagram_size": 65527})["transport.quic.datagram_size"] == 65527


def test_no_credentials_is_refused_at_load(tmp_path, monkeypatch):
    monkeypatch.setenv("ERDMA_KEYS_DIR", str(tmp_path))  # no CA there
    with pytest.raises(ConfigError, match="transport 'quic' needs credentials and found none"):
        load_config({"transport.name": "quic"})
    (tmp_path / "ca.pem").write_text("not a certificate")
    (tmp_path / "ca.key").write_text("not a key")
    with pytest.raises(ConfigError, match=r"transport\.quic: cannot use the CA"):
        load_config({"transport.name": "quic"})
    assert load_config({"transport.name": "quic", "transport.quic.insecure_dev_mode": True})
