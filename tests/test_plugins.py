"""Plugin loading through entry points, the loading rules, and the hook documentation."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from erdma_core.plugins import hookspecs

ROOT = Path(__file__).resolve().parent.parent
HOOKS = [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("erdma_")]


def test_hooks_are_documented():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    assert len(HOOKS) == 9
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        for part in ("Called by", "Returns"):
            assert part in doc, f"hook {name} docstring lacks {part!r}"
        assert ("firstresult" in doc) or ("Every" in doc or "every" in doc), f"{name}: say how results combine"
        assert f"`{name}(" in docs, f"docs/plugins.md does not document {name}"


def test_builtin_implements_every_hook_but_commands():
    """Built-ins register through the same hooks as plugins; the core's commands, and its own lines of
    erdma doctor, are the command line's own (erdma_core.cli.main adds them, and calls the hooks for plugins
    only: no cli -> hook -> builtin -> cli loop)."""
    from erdma_core.plugins import builtin

    cli_side = {"erdma_add_commands", "erdma_doctor"}
    assert sorted(n for n in dir(builtin) if n.startswith("erdma_")) == sorted(set(HOOKS) - cli_side)


@pytest.fixture
def fake_site(tmp_path):
    """A folder on PYTHONPATH holding three plugin 'distributions': a working one, one that fails to
    import, and one with a misspelled hook."""
    (tmp_path / "fakeplug.py").write_text(textwrap.dedent('''
        import os
        from erdma_core.sdk import Option, hookimpl

        def factory(config, section):
            if os.environ.get("FAKE_FAIL"):
                raise ImportError("libfake.so: cannot open shared object file")
            from erdma_core.transport.tcp import TcpTransport
            return TcpTransport(config, {**config.section("transport.tcp"), **section})

        @hookimpl
        def erdma_register_transports(register):
            register("fake", factory, options={"depth": Option(int, 3, "how deep", minimum=1)}, sdk=2)

        @hookimpl
        def erdma_choose_algorithm(op, nbytes, world_size, config):
            return "tree" if op == "allreduce" and config["transport.name"] == "fake" else None
    '''))
    (tmp_path / "brokenplug.py").write_text("raise ImportError('brokenplug needs libnothing')\n")
    (tmp_path / "typoplug.py").write_text(textwrap.dedent('''
        from erdma_core import hookimpl
        @hookimpl
        def erdma_register_transport(register):
            pass
    '''))
    for dist, name, module in (("erdma_fake", "fake", "fakeplug"), ("erdma_broken", "broken", "brokenplug"),
                               ("erdma_typo", "typo", "typoplug")):
        info = tmp_path / f"{dist}-0.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.3\n")
        provides = "\n[erdma.components]\ncompressor.fakecodec = brokenplug\n" if name == "broken" else ""
        (info / "entry_points.txt").write_text(f"[erdma.plugins]\n{name} = {module}\n{provides}")
    return tmp_path


def py(site, code, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    disabled = [os.environ.get("ERDMA_DISABLE_PLUGINS", ""), env.pop("ERDMA_DISABLE_PLUGINS", "")]
    if any(disabled):  # installed plugin distributions stay off (conftest.py), as do the test's own
        full["ERDMA_DISABLE_PLUGINS"] = ",".join(filter(None, disabled))
    full |= {"PYTHONPATH": str(site), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, timeout=60)


def test_entry_point_plugin_registers_and_configures(fake_site):
    r = py(fake_site, '''
        import erdma_core
        from erdma_core.plugins import components
        c = components()
        conf = erdma_core.load_config({"transport.name": "fake", "transport.fake.depth": 5})
        print(c.get("transport", "fake").plugin, conf["transport.fake.depth"])
        print(c.pm.hook.erdma_choose_algorithm(op="allreduce", nbytes=1 << 30, world_size=4, config=conf))
        print(sorted(p.name for p in c.plugins if p.error))
    ''', ERDMA_DISABLE_PLUGINS="typo")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["fake 5", "tree", "['broken']"]
    assert "erdma plugin 'broken' (erdma-broken) failed to load, skipped: ImportError: brokenplug needs" in r.stderr


def test_plugin_options_are_validated(fake_site):
    r = py(fake_site, '''
        import erdma_core
        erdma_core.load_config({"transport.fake.depth": 0})
    ''', ERDMA_PLUGINS="fake")
    assert "config key 'transport.fake.depth': value 0 is below the minimum 1" in r.stderr


def test_selected_component_that_fails_is_a_hard_error(fake_site):
    r = py(fake_site, '''
        from erdma_core.plugins import components
        import erdma_core
        components().create("transport", "fake", erdma_core.load_config(), {"depth": 3})
    ''', ERDMA_PLUGINS="fake", FAKE_FAIL="1")
    assert r.returncode != 0
    assert ("PluginError: transport 'fake' from plugin 'fake' failed to load: ImportError: libfake.so: "
            "cannot open shared object file") in r.stderr


def test_an_allow_list_naming_no_installed_plugin_is_an_error(fake_site):
    r = py(fake_site, 'from erdma_core.plugins import components; components()', ERDMA_PLUGINS="fake,fkae")
    assert r.returncode != 0
    assert "PluginError: ERDMA_PLUGINS='fake,fkae' names 'fkae', which no installed plugin is; installed plugins: " \
        "broken, " in r.stderr and "(did you mean 'fake'?)" in r.stderr


def test_allow_list_block_list_and_trace(fake_site):
    r = py(fake_site, 'from erdma_core.plugins import components; print(sorted(p.name for p in components().plugins))',
           ERDMA_PLUGINS="fake")
    assert r.stdout.strip() == "['builtin', 'fake']"
    r = py(fake_site, 'from erdma_core.plugins import components; print(components().names("transport"))',
           ERDMA_DISABLE_PLUGINS="fake,typo")
    assert r.stdout.strip() == "['tcp']"
    r = py(fake_site, 'from erdma_core.plugins import components; components()', ERDMA_PLUGINS="fake",
           ERDMA_TRACE_PLUGINS="1")
    assert "[erdma.plugins]" in r.stderr


def test_misspelled_hook_fails_loudly(fake_site):
    r = py(fake_site, 'from erdma_core.plugins import components; components()', ERDMA_PLUGINS="typo")
    assert r.returncode != 0 and "PluginValidationError" in r.stderr and "erdma_register_transport" in r.stderr


def test_erdma_plugins_command_lists_plugins_and_errors(fake_site):
    r = py(fake_site, 'import sys; from erdma_core.cli.main import main; sys.exit(main(["plugins"]))',
           ERDMA_DISABLE_PLUGINS="typo")
    assert r.returncode == 0, r.stderr
    assert "erdma-fake" in r.stdout and "erdma_register_transports" in r.stdout
    assert "ImportError: brokenplug needs libnothing" in r.stdout
    lines = [line.split() for line in r.stdout.splitlines()]
    assert ["transport", "fake", "(fake)"] in [line[:3] for line in lines]
    assert ["algorithm", "allreduce", "ring", "(builtin)"] in [line[:4] for line in lines]
    assert ["algorithm", "alltoall", "sequential", "(builtin)"] in [line[:4] for line in lines]


def test_set_up_reads_no_distribution_metadata_until_a_name_is_asked_for(fake_site):
    """Finding which distribution installed each plugin reads every installed distribution's entry points
    (seconds on the verbs guest's 9p share): building the components does none of it, once stevedore has
    cached the entry points; ``erdma plugins`` and the messages look the names up when they need them."""
    r = py(fake_site, '''
        import importlib.metadata as md
        from erdma_core.plugins import manager
        manager.build_plugin_manager()  # stevedore's cache of the entry points made, as after any first run
        read = []
        real = md.PathDistribution.read_text
        md.PathDistribution.read_text = lambda self, name: read.append(name) or real(self, name)
        c = manager.build_plugin_manager()
        print(len(read), sorted(p.name for p in c.plugins))
        print(c.distribution("fake"), c.version("fake"), c.distribution("builtin"), c.distribution("nothing"))
        print(len(read) > 0)
    ''', ERDMA_PLUGINS="fake")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["0 ['builtin', 'fake']", "erdma-fake 0.3 erdma-core ?", "True"]


def test_selected_name_from_a_plugin_that_failed_to_load_says_why(fake_site):
    """Before: "invalid value 'fakecodec'; valid choices: none", and not a word of the plugin that failed. The
    plugin's metadata says it provides the name; a name no plugin declares is told of every plugin that failed."""
    r = py(fake_site, '''
        import erdma_core
        for name in ("fakecodec", "unheard"):
            try:
                erdma_core.load_config({"compression.name": name})
            except erdma_core.ConfigError as exc:
                print(exc)
    ''', ERDMA_PLUGINS="broken")
    assert r.returncode == 0, r.stderr
    named, unheard = r.stdout.splitlines()
    assert named.endswith("config key 'compression.name': invalid value 'fakecodec'; valid choices: none; plugin "
                          "'broken' (erdma-broken) provides it, but failed to load: ImportError: brokenplug needs "
                          "libnothing"), named
    assert unheard.endswith("invalid value 'unheard'; valid choices: none; plugin 'broken' (erdma-broken 0.3) is "
                            "installed but failed to load, so what it provides is missing: ImportError: brokenplug "
                            "needs libnothing"), unheard


def test_every_dotted_name_in_the_hook_contracts_resolves():
    """The contracts name modules, classes and functions; each must exist (a rename must update them)."""
    import importlib
    import re

    names = set()
    for hook in HOOKS:
        names |= set(re.findall(r"``(erdma_core(?:\.\w+)+)``", inspect.getdoc(getattr(hookspecs, hook)) or ""))
    names |= set(re.findall(r"``(erdma_core(?:\.\w+)+)``", hookspecs.__doc__ or ""))
    assert len(names) > 10
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"{name}: {'.'.join(parts[:cut])} has no {attr!r}"
                obj = getattr(obj, attr)
            break
        else:
            raise AssertionError(f"{name} does not resolve")
