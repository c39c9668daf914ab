"""A config is the same verdict on every rank: what cannot take effect fails at load, before the rank contacts
anyone; a rank that fails later in its set-up says why in the job's store, and the others fail with its reason
instead of waiting for their connect timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from erdma_core import ConfigError, load_config
from erdma_core.cli.launcher import free_port

JOIN = "import erdma_core; erdma_core.init()"


def _ranks(n: int, env: dict[str, str], per_rank: dict[int, dict[str, str]] | None = None) -> list[tuple[int, str]]:
    """``n`` processes that each join the job (env://) and exit: their exit codes and stderr."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    base |= {"WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} | env
    procs = [subprocess.Popen([sys.executable, "-c", JOIN], env=base | {"RANK": str(r)} | (per_rank or {}).get(r, {}),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(n)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


@pytest.mark.parametrize(("settings", "key"), [
    ({"compression.ops": "allreduce,bogus"}, "compression.ops"),
    ({"security.require_secret": True}, "security.secret"),
    ({"discovery.init_method": "tcp://nohostport"}, "discovery.init_method"),
    ({"discovery.init_method": "file://"}, "discovery.init_method"),
])
def test_rules_between_keys_fail_at_load_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(settings)


def test_a_config_every_rank_rejects_fails_them_all_before_anyone_is_contacted():
    """The store's port is a socket of the test's that nobody may reach: each of 3 ranks fails at load,
    naming the key, and none connected to it."""
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen(8)
        store.settimeout(0)
        port = store.getsockname()[1]
        env = {"ERDMA_COMPRESSION_OPS": "allreduce,bogus", "MASTER_PORT": str(port)}
        results = _ranks(3, env)
        with pytest.raises(BlockingIOError):
            store.accept()  # nobody knocked
    for code, err in results:
        assert code == 1 and "ConfigError: config key 'compression.ops': invalid value 'allreduce,bogus' ('bogus' is " \
            "not a collective)" in err, err


def test_a_rank_that_fails_in_its_set_up_tells_the_others_why():
    """Rank 1 names a network interface it does not have (found only when its transport binds, after the
    ranks agreed on the job): it fails saying so, and ranks 0 and 2 fail with its reason, not at their 120 s
    connect timeout."""
    env = {"ERDMA_TIMEOUTS_CONNECT": "120"}
    results = _ranks(3, env, {1: {"ERDMA_TRANSPORT_TCP_INTERFACE": "nosuchif0"}})
    why = "config key 'transport.tcp.interface': value 'nosuchif0' has no IPv4 address"
    assert results[1][0] == 1 and why in results[1][1], results[1][1]
    for code, err in (results[0], results[2]):
        assert code == 1 and f"set-up stopped: rank 1: {why}" in err, err
