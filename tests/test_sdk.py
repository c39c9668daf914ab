"""The plugin SDK (``erdma_core.sdk``, the contract) and the toolkit (``erdma_core.toolkit``, the helpers):
every name they list exists, the SDK holds no whole module; the in-tree plugins use nothing of the core outside
them (imports, attribute accesses, and no private of a core class they subclass), their tests nothing beyond
those and the test kit, and none reaches through a group's runtime (``pg.rt``); every in-tree registration says
the SDK version as a number; a plugin written for the previous version loads through the adapter and runs; one
written for another version is refused, by name."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import erdma_core
import erdma_core.elastic
import erdma_core.sdk as sdk
import erdma_core.toolkit as toolkit

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = sorted(p for p in ROOT.glob("plugins/*/erdma_*") if (p / "__init__.py").is_file())
PLUGINS.append(ROOT / "examples" / "erdma-example" / "erdma_example")
PLUGIN_TESTS = sorted(p for p in [*ROOT.glob("plugins/*/tests"), ROOT / "examples" / "erdma-example" / "tests"]
                      if p.is_dir())
REGISTRARS = [ROOT / "erdma_core" / "plugins" / "builtin.py", *(p / "plugin.py" for p in PLUGINS)]
TOOLKIT_MODULES = {n for n in toolkit.__all__ if type(getattr(toolkit, n)) is type(toolkit)}  # auth, meet, ...
OFFERED = {"erdma_core": set(erdma_core.__all__), "erdma_core.sdk": set(sdk.__all__),
           "erdma_core.toolkit": set(toolkit.__all__)}
# what a plugin's tests may use besides: the test kit, the elastic API, the command line, the torch backend
TEST_KIT = {"erdma_core.elastic": set(erdma_core.elastic.__all__), "erdma_core.cli.main": {"main"}}
TEST_KIT_PACKAGES = ("erdma_core.testing",)
TEST_KIT_IMPORTS = {"erdma_core.torch"}


def _sources(packages: list[Path]) -> Iterator[tuple[str, ast.AST]]:
    """``(where, tree)`` of each module: ``where`` is its path from the distribution's folder on."""
    for pkg in packages:
        for path in sorted(pkg.rglob("*.py")):
            yield str(path.relative_to(pkg.parent.parent)), ast.parse(path.read_text(encoding="utf-8"))


def outside_the_sdk(packages: list[Path], tests: bool = False) -> list[str]:
    """Each use of the core by ``packages`` that the SDK, the toolkit and the public API do not offer (and,
    for ``tests``, the test kit), and each reach through ``.rt``, as ``file:line: what``."""
    offered = OFFERED | (TEST_KIT if tests else {})
    bad = []
    for where, tree in _sources(packages):
        modules: set[str] = set()  # names bound to a toolkit module in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "erdma_core":
                if tests and node.module.startswith(TEST_KIT_PACKAGES):
                    continue
                for alias in node.names:
                    if alias.name not in offered.get(node.module, ()):
                        bad.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
                    elif node.module == "erdma_core.toolkit" and alias.name in TOOLKIT_MODULES:
                        modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                bad += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                        if a.name.startswith("erdma_core.") and a.name not in {"erdma_core.sdk", "erdma_core.toolkit"}
                        and not (tests and (a.name in TEST_KIT_IMPORTS or a.name.startswith(TEST_KIT_PACKAGES)))]
            elif isinstance(node, ast.Attribute):
                if node.attr == "rt":
                    bad.append(f"{where}:{node.lineno}: .rt (a group's runtime: ProcessGroup offers transport, "
                               "store, config and slow_links)")
                elif isinstance(node.value, ast.Name):
                    owner, name = node.value.id, node.attr
                    if owner == "erdma_core" and name not in erdma_core.__all__ and name not in ("sdk", "toolkit"):
                        bad.append(f"{where}:{node.lineno}: erdma_core.{name}")
                    elif owner in modules and name.startswith("_"):
                        bad.append(f"{where}:{node.lineno}: {owner}.{name}")
    return bad


def _privates(tree: ast.AST) -> set[str]:
    """The underscore names a module's classes define: methods and ``self._x`` attributes."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id.startswith("_"):
                names.add(node.id)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def privates_of_the_core(packages: list[Path]) -> list[str]:
    """Each ``x._name`` in ``packages`` where ``_name`` is a private of a core class and not one of the
    package's own (a subclass reaching into its base, or a plugin into a core object it was handed)."""
    core = set().union(*(_privates(t) for _, t in _sources([ROOT / "erdma_core"])))
    bad = []
    for pkg in packages:
        own = set().union(*(_privates(t) for _, t in _sources([pkg])))
        for where, tree in _sources([pkg]):
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in core - own:
                    bad.append(f"{where}:{node.lineno}: .{node.attr}")
    return bad


def test_every_name_the_sdk_and_the_toolkit_list_exists_once_and_the_sdk_holds_no_module() -> None:
    for module in (sdk, toolkit):
        assert len(module.__all__) == len(set(module.__all__))
        assert [n for n in module.__all__ if not hasattr(module, n)] == []
    assert set(sdk.__all__).isdisjoint(toolkit.__all__)
    assert [n for n in sdk.__all__ if type(getattr(sdk, n)) is type(sdk)] == []
    assert sdk.VERSION == 2 and isinstance(sdk.VERSION, int) and toolkit.TOOLKIT_VERSION == 1
    assert sdk.VERSION_1_MOVED <= set(toolkit.__all__)  # the adapter serves each of them


def test_the_plugins_use_nothing_of_the_core_outside_the_sdk_and_the_toolkit() -> None:
    assert outside_the_sdk(PLUGINS) == []
    assert privates_of_the_core(PLUGINS) == []


def test_the_plugins_tests_use_the_sdk_the_toolkit_and_the_test_kit_only() -> None:
    assert outside_the_sdk(PLUGIN_TESTS, tests=True) == []


def test_the_walks_find_what_they_look_for(tmp_path: Path) -> None:
    """The checkers themselves, on a made-up plugin: they must not pass by finding nothing."""
    pkg = tmp_path / "plugins" / "erdma-made" / "erdma_made"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "t.py").write_text(textwrap.dedent("""
        import erdma_core
        import erdma_core.engine.executor
        from erdma_core.toolkit import MessageTransport, auth
        from erdma_core.transport.mailbox import Mailbox
        from erdma_core import init
        from erdma_core.sdk import SocketTransport

        class T(MessageTransport):
            def peers_now(self, pg):
                return list(self._inboxes), auth._tag, erdma_core.init, erdma_core.default_group, pg.rt.store

            def _mine(self):
                return self._mine
    """))
    assert outside_the_sdk([pkg]) == [
        "erdma-made/erdma_made/t.py:3: import erdma_core.engine.executor",
        "erdma-made/erdma_made/t.py:5: from erdma_core.transport.mailbox import Mailbox",
        "erdma-made/erdma_made/t.py:7: from erdma_core.sdk import SocketTransport",  # SDK 1's: the toolkit's now
        "erdma-made/erdma_made/t.py:11: auth._tag",
        "erdma-made/erdma_made/t.py:11: .rt (a group's runtime: ProcessGroup offers transport, store, config and "
        "slow_links)",
    ]
    tests = tmp_path / "plugins" / "erdma-made" / "tests"
    tests.mkdir()
    (tests / "test_t.py").write_text(textwrap.dedent("""
        import erdma_core.torch
        from erdma_core.testing.world import World
        from erdma_core.elastic import found
        from erdma_core.wire import DATA
        from erdma_core.cli.main import main
    """))
    assert outside_the_sdk([tests], tests=True) == ["erdma-made/tests/test_t.py:5: from erdma_core.wire import DATA"]
    assert "erdma-made/tests/test_t.py:2: import erdma_core.torch" in outside_the_sdk([tests])
    found = privates_of_the_core([pkg])
    assert any(f.endswith("t.py:11: ._inboxes") for f in found), found
    assert not any("._mine" in f for f in found)


def _registrations() -> Iterator[tuple[Path, ast.Call]]:
    for path in REGISTRARS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if (isinstance(fn, ast.FunctionDef) and fn.name.startswith("erdma_register_")
                    and fn.name != "erdma_register_environment"):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "register":
                        yield path, node


def test_every_in_tree_registration_says_its_sdk_version_as_a_number() -> None:
    calls = list(_registrations())
    assert len(calls) >= 40  # the core's built-ins, six plugins and the example
    said = {(p.relative_to(ROOT), c.lineno): next((k.value for k in c.keywords if k.arg == "sdk"), None)
            for p, c in calls}
    assert {where: v for where, v in said.items()
            if not (isinstance(v, ast.Constant) and v.value == sdk.VERSION)} == {}


def _mypy(*files: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--ignore-missing-imports", "--follow-imports=silent", "--no-incremental", "--cache-dir", os.devnull,
             "--no-error-summary"]
    return subprocess.run([sys.executable, "-m", "mypy", *flags, *map(str, files)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_mypy_checks_every_registration_against_the_register_protocols(tmp_path: Path) -> None:
    """The registration hooks take ``Register``/``RegisterAlgorithm``/``RegisterEnvironment``: mypy checks
    every in-tree plugin's calls against them, and finds a call that is wrong."""
    checked = _mypy(*(p / "plugin.py" for p in PLUGINS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    wrong = tmp_path / "wrongplug.py"
    wrong.write_text(textwrap.dedent('''
        from erdma_core.sdk import Register, RegisterAlgorithm, hookimpl

        @hookimpl
        def erdma_register_transports(register: Register) -> None:
            register("x", object, sdk="1")

        @hookimpl
        def erdma_register_algorithms(register: RegisterAlgorithm) -> None:
            register("allreduce", object, sdk=1)
    '''))
    found = _mypy(wrong)
    assert found.returncode == 1
    assert 'Argument "sdk" to "__call__" of "Register" has incompatible type "str"; expected "int | None"' in found.stdout
    assert 'Missing positional argument "schedule_fn" in call to "__call__" of "RegisterAlgorithm"' in found.stdout


def test_a_plugin_written_for_another_sdk_version_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "versionsplug.py").write_text(textwrap.dedent('''
        from erdma_core.sdk import hookimpl

        def factory(config, section):
            raise AssertionError("a refused component is never made")

        @hookimpl
        def erdma_register_transports(register):
            register("older", factory, sdk=0)
            register("unsaid", factory)

        @hookimpl
        def erdma_register_compressors(register):
            register("newer", factory, sdk=3)
            register("plain", factory)  # another kind than transport with no version: SDK 1's rule, adapted
    '''))
    info = tmp_path / "erdma_versions-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: erdma-versions\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[erdma.plugins]\nversions = versionsplug\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    env |= {"PYTHONPATH": str(tmp_path), "ERDMA_PLUGINS": "versions"}
    code = textwrap.dedent('''
        import erdma_core
        from erdma_core.plugins import components
        c = components()
        print(sorted(c.names("compressor")))
        try:
            erdma_core.load_config({"transport.name": "older"})
        except erdma_core.ConfigError as exc:
            print("ConfigError:", exc)
        try:
            c.create("transport", "older", None, {})
        except erdma_core.PluginError as exc:
            print("PluginError:", exc)
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    names, config_error, error = r.stdout.splitlines()
    assert names == "['none', 'plain']"
    why = (f"transport 'older' of plugin 'versions' (erdma-versions) was written for SDK version 0; this erdma-core "
           f"({erdma_core.__version__}) provides SDK version 2 (erdma_core.sdk.VERSION) and, through an adapter, "
           "version 1: install a release of erdma-versions written for one of them, or, as its author, port it to "
           "erdma_core.sdk and register it with sdk=2")
    assert error == f"PluginError: {why}"
    assert config_error == ("ConfigError: argument: config key 'transport.name': invalid value 'older'; valid "
                            f"choices: tcp; it is refused: {why}")
    assert "transport 'unsaid' of plugin 'versions' (erdma-versions) says no SDK version" in r.stderr
    assert "compressor 'newer' of plugin 'versions' (erdma-versions) was written for SDK version 3" in r.stderr
    listed = subprocess.run([sys.executable, "-m", "erdma_core.cli", "plugins"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    refused = [line.split()[:3] for line in listed.stdout.splitlines() if "REFUSED" in line]
    assert refused == [["compressor", "newer", "REFUSED:"], ["transport", "older", "REFUSED:"],
                       ["transport", "unsaid", "REFUSED:"]]
    assert [line.split()[:2] for line in listed.stdout.splitlines() if "[SDK 1, through the adapter]" in line] == [
        ["compressor", "plain"]]


V1_PLUGIN = '''
"""A plugin as it was written for SDK version 1: its transport subclasses SocketTransport, imported from
erdma_core.sdk with the helpers it uses, and registers with sdk=1; its compressor says no version."""
import os
import socket
import tempfile

import numpy as np
from erdma_core.sdk import Encoded, Option, SocketTransport, hookimpl, retrying


class OldUnix(SocketTransport):
    name, key = "OldUnix", "oldunix"

    def __init__(self, config, section):
        super().__init__()
        self.path = ""

    def listen(self, ctx):
        self.path = os.path.join(tempfile.gettempdir(), f"erdma-v1-{ctx.job:016x}-{ctx.rank}.sock")
        if os.path.exists(self.path):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(ctx.world_size)
        return [(sock, self.path)]

    def dial(self, address, deadline):
        def connect(timeout):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                raise
            return sock
        return retrying(connect, deadline)

    def shutdown(self):
        super().shutdown()
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)


class Same:
    name, lossy = "same", False

    def encode(self, data, dtype, site):
        return Encoded(np.ascontiguousarray(data).view(np.uint8).copy())

    def decode(self, payload, meta, dtype, out):
        out.view(np.uint8)[:] = np.frombuffer(payload, np.uint8)


@hookimpl
def erdma_register_transports(register):
    register("oldunix", OldUnix, options={"unused": Option(int, 0, "kept from version 1")}, sdk=1)


@hookimpl
def erdma_register_compressors(register):
    register("same", lambda config, section: Same())
'''

V1_JOB = '''
import warnings
import numpy as np
from erdma_core.testing import World


def reduce(pg):
    x = np.arange(4096, dtype=np.float32) * (pg.rank() + 1)
    pg.allreduce(x)
    return x, type(pg.transport).__name__


if __name__ == "__main__":
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        import v1plug  # noqa: F401
    print([str(w.message) for w in said])
    with World(2, config={"transport.name": "oldunix", "compression.name": "same", "compression.min_bytes": 0},
               timeout=60) as world:
        (a, t), (b, _) = world.run(reduce)
    expect = np.arange(4096, dtype=np.float32) * 3
    print(bool(np.array_equal(a, expect) and np.array_equal(b, expect)), t)
'''


def test_a_plugin_written_for_sdk_version_1_loads_through_the_adapter_and_runs(tmp_path: Path) -> None:
    """The previous SDK version's plugin, unchanged: its imports of what moved to the toolkit are served with
    a warning that says where, both components load, and a 2-rank job allreduces through them."""
    (tmp_path / "v1plug.py").write_text(V1_PLUGIN)
    (tmp_path / "v1job.py").write_text(V1_JOB)
    info = tmp_path / "erdma_v1plug-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: erdma-v1plug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[erdma.plugins]\nv1plug = v1plug\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    env |= {"PYTHONPATH": str(tmp_path), "ERDMA_PLUGINS": "v1plug", "ERDMA_DEBUG": "info"}
    r = subprocess.run([sys.executable, str(tmp_path / "v1job.py")], capture_output=True, text=True, env=env,
                       timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    warned, outcome = r.stdout.splitlines()[-2:]
    assert "erdma_core.sdk.SocketTransport is SDK version 1's; since version 2 it is erdma_core.toolkit.SocketTransport" \
        in warned and "erdma_core.sdk.retrying is SDK version 1's" in warned, warned
    assert outcome == "True OldUnix", r.stdout
    assert ("transport 'oldunix' of plugin 'v1plug' (erdma-v1plug) was written for SDK version 1 (sdk=1): it runs "
            "through the adapter for that version") in r.stderr
    assert "compressor 'same' of plugin 'v1plug' (erdma-v1plug) was written for SDK version 1 (it says none)" in r.stderr


def test_each_in_tree_plugins_metadata_says_what_it_registers() -> None:
    """``erdma.components`` (what a plugin's distribution says it provides: the core's hints read it) and what
    the plugin registers are the same names, for every in-tree plugin installed here."""
    code = textwrap.dedent('''
        import json
        from erdma_core.plugins import components
        c = components()
        made = {f"{comp.kind}.{comp.op + '.' if comp.op else ''}{comp.name}": comp.plugin
                for kind in [*c.by_kind.values(), *c.algorithms.values()] for comp in kind.values()}
        print(json.dumps({"said": dict(c.provided),
                          "made": {k: p for k, p in made.items() if p != "builtin"}}))
    ''')
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}  # every installed plugin
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    said, made = out["said"], out["made"]
    in_tree = {p.parent.name.removeprefix("erdma-") for p in PLUGINS} | {"example"}
    assert {k: v for k, v in said.items() if v in in_tree} == {k: v for k, v in made.items() if v in in_tree}
    assert len(said) >= 4, said  # (at least one in-tree plugin is installed where the suite runs)
