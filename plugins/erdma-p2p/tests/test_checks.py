"""erdma-p2p's settings that cannot take effect are refused when the config is loaded, on every rank, before
the rank contacts anyone: the DHT's bootstrap node, the STUN server and the relay (sockets of the test's)
hear nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from erdma_core import ConfigError, load_config

STUN = {"traversal.name": "stun", "traversal.stun.server": "127.0.0.1:3478"}


@pytest.mark.parametrize(("settings", "message"), [
    ({"transport.fallback": "quic", "traversal.name": "direct"}, "config key 'transport.fallback': value 'quic' takes "
     "the pairs the built-in TCP cannot meet through their NATs, and traversal.name = \"direct\" meets none"),
    ({"transport.fallback": "tcp"}, "config key 'transport.fallback': value 'tcp' is the first transport"),
    ({"transport.name": "quic", "transport.fallback": "quic", "security.secret": "s"},
     "config key 'transport.fallback': value 'quic' takes the pairs the built-in TCP cannot connect, and "
     "transport.name is 'quic'"),
    ({"transport.fallback": "unix"}, "config key 'transport.fallback': value 'unix' connects every rank of a job and "
     "cannot carry only the pairs another transport left; valid: none, quic"),
    ({"transport.fallback": "udp"}, "config key 'transport.fallback': invalid value 'udp'; valid choices: none,"),
    ({"transport.fallback": "quic", "traversal.stun.port": 7000, "security.secret": "s"},
     "config key 'traversal.stun.port': value 7000 would be both the TCP port and the UDP port"),
    ({"transport.fallback": "quic", "transport.quic.workers": 2, "security.secret": "s",
      "traversal.stun.relay": "127.0.0.1:3478", "traversal.stun.relay_user": "u", "traversal.stun.relay_password": "p"},
     "config key 'transport.quic.workers': value 2 needs a socket per lane"),
])
def test_a_fallback_transport_that_cannot_take_effect_is_refused_at_load(settings, message):
    with pytest.raises(ConfigError) as err:
        load_config({**STUN, "transport.name": "tcp", **settings})
    assert message in str(err.value)


def test_tcp_with_a_relay_and_quic_as_the_fallback_is_a_valid_config():
    conf = load_config({**STUN, "transport.name": "tcp", "transport.fallback": "quic", "security.secret": "s",
                        "traversal.stun.relay": "127.0.0.1:3478", "traversal.stun.relay_user": "u",
                        "traversal.stun.relay_password": "p"})
    assert (conf["transport.name"], conf["transport.fallback"]) == ("tcp", "quic")


@pytest.mark.parametrize(("settings", "message"), [
    ({"transport.name": "tcp", "traversal.stun.relay": "127.0.0.1:3478", "traversal.stun.relay_user": "u",
      "traversal.stun.relay_password": "p"}, "config key 'traversal.stun.relay': value '127.0.0.1:3478' cannot be "
     "used with transport.name = \"tcp\""),
    ({"transport.name": "tcp", "traversal.stun.punch": False}, "config key 'traversal.stun.punch': value False"),
    ({"transport.name": "tcp", "transport.tcp.connections": 4}, "config key 'transport.tcp.connections': value 4"),
    ({"transport.name": "tcp", "transport.tcp.port": 7000}, "config key 'transport.tcp.port': value 7000"),
    ({"traversal.stun.relay": "127.0.0.1:3478"}, "needs traversal.stun.relay_user and traversal.stun.relay_password"),
    ({"traversal.stun.relay_when": "always"}, "config key 'traversal.stun.relay_when': value 'always' needs"),
    ({"traversal.stun.relay_over": "tcp"}, "config key 'traversal.stun.relay_over': value 'tcp' needs "
     "traversal.stun.relay"),
    ({"traversal.stun.relay_over": "tls"}, "config key 'traversal.stun.relay_over': value 'tls' needs "
     "traversal.stun.relay"),
    ({"traversal.stun.relay_over": "dtls"}, "config key 'traversal.stun.relay_over': invalid value 'dtls'; valid "
     "choices: auto, udp, tcp, tls"),
    ({"traversal.stun.relay_ca": "/nonexistent/ca.pem"}, "config key 'traversal.stun.relay_ca': value "
     "'/nonexistent/ca.pem' is not a file; valid: a PEM file of the CA"),
    ({"traversal.stun.server": "nohost"}, "config key 'traversal.stun.server': value 'nohost' is not HOST:PORT"),
    ({"transport.name": "quic", "security.secret": "s", "transport.quic.workers": 2,
      "traversal.stun.relay": "127.0.0.1:3478", "traversal.stun.relay_user": "u", "traversal.stun.relay_password": "p"},
     "config key 'transport.quic.workers': value 2 needs a socket per lane"),
])
def test_stun_settings_that_cannot_take_effect_are_refused_at_load(settings, message):
    with pytest.raises(ConfigError) as err:
        load_config({**STUN, **settings})
    assert message in str(err.value)


@pytest.mark.parametrize(("url", "message"), [
    ("dht://127.0.0.1:4222/", "needs bootstrap nodes and a job name"),
    ("dht://127.0.0.1/job", "bootstrap node '127.0.0.1' in 'dht://127.0.0.1/job' is not HOST:PORT"),
])
def test_dht_urls_that_cannot_work_are_refused_at_load(url, message):
    with pytest.raises(ConfigError, match=r"config key 'discovery\.init_method'") as err:
        load_config({"discovery.init_method": url, "security.secret": "s"})
    assert message in str(err.value)
    with pytest.raises(ConfigError, match=r"config key 'security\.secret': the dht:// discovery signs"):
        load_config({"discovery.init_method": "dht://127.0.0.1:4222/job"})


def test_four_ranks_with_a_relay_on_tcp_all_fail_at_once_and_contact_nobody():
    """The job of the issue: dht:// discovery, stun with a TURN relay, the built-in TCP. Each of the 4 ranks
    fails naming the key; the bootstrap node's, STUN's and TURN's ports (UDP sockets of the test) got nothing."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    dht, stun, turn = (f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")} | {
        "WORLD_SIZE": "4", "ERDMA_INIT_METHOD": f"dht://{dht}/job-relay-on-tcp", "ERDMA_SECRET": "s",
        "ERDMA_TRANSPORT": "tcp", "ERDMA_TRAVERSAL": "stun", "ERDMA_TRAVERSAL_STUN_SERVER": stun,
        "ERDMA_TRAVERSAL_STUN_RELAY": turn, "ERDMA_TRAVERSAL_STUN_RELAY_USER": "u",
        "ERDMA_TRAVERSAL_STUN_RELAY_PASSWORD": "p"}
    procs = [subprocess.Popen([sys.executable, "-c", "import erdma_core; erdma_core.init()"], env=env | {"RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(4)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
        results = [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]
        for s in socks:
            with pytest.raises(BlockingIOError):
                s.recv(2048)  # nothing came
    finally:
        for p in procs:
            p.kill()
        for s in socks:
            s.close()
    for code, err in results:
        assert code == 1, err
        assert err.strip().splitlines()[-1] == (
            f"erdma_core.errors.ConfigError: config key 'traversal.stun.relay': value '{turn}' cannot be used with "
            "transport.name = \"tcp\" alone: a TURN server relays datagrams, and the built-in TCP meets its peers over "
            "TCP only; set transport.fallback = \"quic\" (TCP for the pairs that meet, QUIC through the relay for the "
            "rest), or transport.name = \"quic\", or leave relay empty"), err
