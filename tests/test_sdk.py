"""The plugin SDK (``erdma_core.sdk``): every name it lists exists; the in-tree plugins use nothing of the core
outside it (imports, attribute accesses, and no private of a core class they subclass); every in-tree
registration says its SDK version as a number; a plugin written for another version is refused, by name."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import erdma_core
import erdma_core.sdk as sdk

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = sorted(p for p in ROOT.glob("plugins/*/erdma_*") if (p / "__init__.py").is_file())
PLUGINS.append(ROOT / "examples" / "erdma-example" / "erdma_example")
REGISTRARS = [ROOT / "erdma_core" / "plugins" / "builtin.py", *(p / "plugin.py" for p in PLUGINS)]
SDK_MODULES = {n for n in sdk.__all__ if type(getattr(sdk, n)) is type(sdk)}  # auth, dtypes, integrity, ...


def _sources(packages: list[Path]) -> Iterator[tuple[str, ast.AST]]:
    """``(where, tree)`` of each module: ``where`` is its path from the distribution's folder on."""
    for pkg in packages:
        for path in sorted(pkg.rglob("*.py")):
            yield str(path.relative_to(pkg.parent.parent)), ast.parse(path.read_text(encoding="utf-8"))


def outside_the_sdk(packages: list[Path]) -> list[str]:
    """Each use of the core by ``packages`` that the SDK does not offer, as ``file:line: what``."""
    bad = []
    for where, tree in _sources(packages):
        modules: set[str] = set()  # names bound to an SDK module in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "erdma_core":
                offered = set(sdk.__all__) if node.module == "erdma_core.sdk" else (
                    set(erdma_core.__all__) if node.module == "erdma_core" else set())
                for alias in node.names:
                    if alias.name not in offered:
                        bad.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
                    elif alias.name in SDK_MODULES:
                        modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                bad += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                        if a.name.startswith("erdma_core.") and a.name != "erdma_core.sdk"]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner, name = node.value.id, node.attr
                if owner == "erdma_core" and name not in erdma_core.__all__ and name != "sdk":
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


def test_every_name_the_sdk_lists_exists_once() -> None:
    assert len(sdk.__all__) == len(set(sdk.__all__))
    assert [n for n in sdk.__all__ if not hasattr(sdk, n)] == []
    assert sdk.VERSION == 1 and isinstance(sdk.VERSION, int)


def test_the_plugins_use_nothing_of_the_core_outside_the_sdk() -> None:
    assert outside_the_sdk(PLUGINS) == []
    assert privates_of_the_core(PLUGINS) == []


def test_the_walks_find_what_they_look_for(tmp_path: Path) -> None:
    """The checkers themselves, on a made-up plugin: they must not pass by finding nothing."""
    pkg = tmp_path / "plugins" / "erdma-made" / "erdma_made"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "t.py").write_text(textwrap.dedent("""
        import erdma_core
        import erdma_core.engine.executor
        from erdma_core.sdk import MessageTransport, auth
        from erdma_core.transport.mailbox import Mailbox
        from erdma_core import init

        class T(MessageTransport):
            def peers_now(self):
                return list(self._inboxes), auth._tag, erdma_core.init, erdma_core.default_group

            def _mine(self):
                return self._mine
    """))
    assert outside_the_sdk([pkg]) == [
        "erdma-made/erdma_made/t.py:3: import erdma_core.engine.executor",
        "erdma-made/erdma_made/t.py:5: from erdma_core.transport.mailbox import Mailbox",
        "erdma-made/erdma_made/t.py:10: auth._tag",
    ]
    found = privates_of_the_core([pkg])
    assert any(f.endswith("t.py:10: ._inboxes") for f in found), found
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
            register("newer", factory, sdk=2)
            register("plain", factory)  # other kinds are checked only when they say a version
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
           f"({erdma_core.__version__}) provides SDK version 1 (erdma_core.sdk.VERSION): install a release of "
           "erdma-versions written for it, or, as its author, port it to erdma_core.sdk and register it with sdk=1")
    assert error == f"PluginError: {why}"
    assert config_error == ("ConfigError: argument: config key 'transport.name': invalid value 'older'; valid "
                            f"choices: tcp; it is refused: {why}")
    assert "transport 'unsaid' of plugin 'versions' (erdma-versions) says no SDK version" in r.stderr
    assert "compressor 'newer' of plugin 'versions' (erdma-versions) was written for SDK version 2" in r.stderr
    listed = subprocess.run([sys.executable, "-m", "erdma_core.cli", "plugins"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    refused = [line.split()[:3] for line in listed.stdout.splitlines() if "REFUSED" in line]
    assert refused == [["compressor", "newer", "REFUSED:"], ["transport", "older", "REFUSED:"],
                       ["transport", "unsaid", "REFUSED:"]]
