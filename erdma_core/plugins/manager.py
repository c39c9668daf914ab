"""Plugin loading, one path: stevedore lists and loads the entry points of ``erdma.plugins``, pluggy holds
their hooks and calls them, and each component's plugin is the name pluggy registered it under. What a
plugin provides is its distribution's metadata (entry points ``erdma.components``: ``"transport.quic" =
"erdma_quic.plugin"``), read through stevedore too, so the core names the plugin a missing name needs
without a table of its own.

Environment switches: ``ERDMA_PLUGINS`` (comma list: load only these external plugins),
``ERDMA_DISABLE_PLUGINS`` (comma list: skip these), ``ERDMA_TRACE_PLUGINS=1`` (log every hook call).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import pluggy

from ..config.option import Option, did_you_mean
from ..errors import ErdmaError, PluginError
from ..protocol.sdk import PREVIOUS as SDK_PREVIOUS
from ..protocol.sdk import VERSION as SDK_VERSION
from . import hookspecs

log = logging.getLogger("erdma.plugins")
ENTRY_POINT_GROUP = "erdma.plugins"
KINDS = ("transport", "discovery", "traversal", "compressor")
SECTION = {"transport": "transport", "discovery": "discovery", "traversal": "traversal", "compressor": "compression"}
COMPONENTS_GROUP = "erdma.components"  # what each plugin provides: "<kind>.<name>" -> its plugin module


@attrs.frozen(eq=False)
class Component:
    """A registered component. ``op`` is set for algorithms (the collective it implements)."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    options: Mapping[str, Option] = attrs.field(factory=dict)
    description: str = ""
    op: str = ""
    offload: bool = False  # an algorithm whose factory makes an ``engine.offload.Offload``, not a schedule
    sdk: int | None = None  # the version of ``erdma_core.sdk`` it says it was written for
    check: hookspecs.Check | None = None  # its rules over the config (``hookspecs.Check``)

    @property
    def section(self) -> str:
        """The component's config section: ``[transport.quic]``, ``[algorithm.allreduce.ring]``, ..."""
        return f"algorithm.{self.op}.{self.name}" if self.kind == "algorithm" else f"{SECTION[self.kind]}.{self.name}"


@attrs.frozen
class PluginInfo:
    """A plugin that loaded (its hooks) or failed to (``error``); ``entry_point`` is None for erdma-core's
    built-ins. Which distribution installed it, and that one's version: ``Components.distribution``."""

    name: str
    hooks: tuple[str, ...]
    error: str | None = None
    entry_point: Any = attrs.field(default=None, eq=False, repr=False)


class Components:
    """What the loaded plugins registered, and the plugin manager that answers decision hooks."""

    def __init__(self, pm: pluggy.PluginManager, plugins: list[PluginInfo]) -> None:
        self.pm = pm
        self.plugins = plugins
        self.entry_points: dict[str, Any] = {}  # every installed plugin's, loaded or not
        self._dist_by_name: dict[str, str] | None = None  # entry point name -> distribution (``_owners``)
        self.by_kind: dict[str, dict[str, Component]] = {k: {} for k in KINDS}
        self.algorithms: dict[str, dict[str, Component]] = {}
        self.codecs: dict[int, Component] = {}  # compressors by wire codec id
        self.environment: dict[str, tuple[str, str]] = {}  # ERDMA_* variable -> (plugin, description)
        self.skipped: set[str] = set()  # installed plugins ERDMA_PLUGINS/ERDMA_DISABLE_PLUGINS left out
        # what installed plugins say they provide (their metadata): "transport.quic" -> plugin
        self.provided: dict[str, str] = {}
        # components registered for another SDK version: (kind, name) -> why (kind "algorithm": name is "op name")
        self.refused: dict[tuple[str, str], str] = {}
        # components that run through the adapter of an earlier SDK version: (kind, name) -> that version
        self.adapted: dict[tuple[str, str], int] = {}

    def names(self, kind: str) -> list[str]:
        return sorted(self.by_kind[kind])

    def distribution(self, plugin: str) -> str:
        """The distribution that installed ``plugin`` ("?" if none says so). Looked up when first asked, for
        messages and ``erdma plugins``: it reads every installed distribution's entry points, which costs a
        second or more on a slow file system (a guest's 9p share), and set-up needs none of it."""
        ep = self.entry_points.get(plugin)
        if ep is None:
            return "erdma-core" if plugin == "builtin" else "?"
        name = getattr(getattr(ep, "dist", None), "name", None)  # stevedore's cached entry points have none
        if name:
            return str(name)
        if self._dist_by_name is None:
            self._dist_by_name = _owners()
        return self._dist_by_name.get(ep.name, "?")

    def version(self, plugin: str) -> str:
        """The version of the distribution that installed ``plugin``."""
        return _version(self.distribution(plugin))

    def hint(self, kind: str) -> Callable[[str], str]:
        """Advice for an unknown name: why it is refused, or which installed plugin provides it (its
        metadata says) and why it is missing (it failed to load, or is left out), or the name an installed
        plugin provides that it resembles; else that no installed plugin provides it."""
        def provider(name: str) -> str | None:
            if kind == "algorithm":
                return next((v for k, v in self.provided.items() if k.startswith("algorithm.")
                             and k.rsplit(".", 1)[1] == name), None)
            return self.provided.get(f"{kind}.{name}")

        def why_missing(plugin: str) -> str:
            dist = self.distribution(plugin)
            info = next((p for p in self.plugins if p.name == plugin), None)
            if info is not None and info.error:
                return f"plugin {plugin!r} ({dist}) provides it, but failed to load: {info.error}"
            if plugin in self.skipped:
                return (f"plugin {plugin!r} ({dist} {_version(dist)}) provides it, but is left out by "
                        "ERDMA_PLUGINS/ERDMA_DISABLE_PLUGINS")
            return f"plugin {plugin!r} ({dist}) says it provides it, but registered no such {kind} on this host"

        def advise(name: str) -> str:
            refusal = self.refused.get((kind, name)) or next(
                (why for (k, n), why in self.refused.items() if k == kind == "algorithm" and n.endswith(f" {name}")),
                None)
            if refusal:
                return f"; it is refused: {refusal}"
            found = provider(name)
            if found is not None:
                return "; " + why_missing(found)
            failed = [p for p in self.plugins if p.error]
            if failed:
                return "".join(f"; plugin {p.name!r} ({self.distribution(p.name)} {self.version(p.name)}) is "
                               f"installed but failed to load, so what it provides is missing: {p.error}"
                               for p in failed)
            declared = [k.rsplit(".", 1)[1] for k in self.provided if k.startswith(f"{kind}.")]
            close = difflib.get_close_matches(name, declared, n=1, cutoff=0.6)
            registered = self.by_kind[kind] if kind in self.by_kind else {n for a in self.algorithms.values() for n in a}
            if close and close[0] in registered:
                return ""  # the valid choices, and the did-you-mean beside them, say it
            other = provider(close[0]) if close else None
            if other is not None:
                return f"; did you mean {close[0]!r}? " + why_missing(other)
            return (f"; no installed plugin provides {kind} {name!r} (eRDMA's plugins are distributions of their "
                    "own: README.md, \"Plugins\", lists what each provides)")
        return advise

    def get(self, kind: str, name: str) -> Component:
        try:
            return self.by_kind[kind][name]
        except KeyError:
            if (kind, name) in self.refused:
                raise PluginError(self.refused[kind, name]) from None
            installed = ", ".join(self.names(kind)) or "(none)"
            raise PluginError(f"Unknown {kind} {name!r}; installed: {installed}"
                              + did_you_mean(name, self.names(kind)) + self.hint(kind)(name)) from None

    def create(self, kind: str, name: str, *args: Any) -> Any:
        """Instantiate a selected component; a failure is a hard error naming the plugin and the cause."""
        return instantiate(self.get(kind, name), *args)

    def algorithm(self, op: str, name: str) -> Component:
        try:
            return self.algorithms[op][name]
        except KeyError:
            if ("algorithm", f"{op} {name}") in self.refused:
                raise PluginError(self.refused["algorithm", f"{op} {name}"]) from None
            known = ", ".join(sorted(self.algorithms.get(op, {}))) or "(none)"
            raise PluginError(f"Unknown {op} algorithm {name!r}; installed: {known}"
                              + did_you_mean(name, list(self.algorithms.get(op, {})))
                              + self.hint("algorithm")(name)) from None

    def selected(self, config: Any) -> list[Component]:
        """The components ``config`` selects: its transport, traversal, compressor, discovery method (the
        init_method's scheme) and the algorithms ``[collectives]`` names."""
        from urllib.parse import urlparse

        url = config["discovery.init_method"]
        names = {"transport": config["transport.name"], "traversal": config["traversal.name"],
                 "compressor": config["compression.name"], "discovery": urlparse(url).scheme or url}
        out = [self.by_kind[k][n] for k, n in names.items() if n in self.by_kind[k]]
        if config["transport.fallback"] in self.by_kind["transport"]:
            out.append(self.by_kind["transport"][config["transport.fallback"]])
        return out + [algos[name] for op, algos in self.algorithms.items()
                      if (name := config.section("collectives").get(op)) in algos]

    def check(self, config: Any) -> None:
        """Every selected component's rules over ``config`` (``hookspecs.Check``): the first that fails raises
        its ConfigError; a check that fails otherwise is a PluginError naming it."""
        for comp in self.selected(config):
            if comp.check is None:
                continue
            try:
                comp.check(config, config.section(comp.section))
            except ErdmaError:
                raise
            except Exception as exc:
                raise PluginError(f"{comp.kind} {comp.name!r} from plugin {comp.plugin!r}: its config check failed: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def option_sections(self) -> dict[str, dict[str, Option]]:
        """Plugin-declared config sections: ``[<kind>.<name>]``, ``[algorithm.<op>.<name>]``."""
        comps = [c for kind in self.by_kind.values() for c in kind.values()]
        comps += [c for op in self.algorithms.values() for c in op.values()]
        return {c.section: dict(c.options) for c in comps if c.options}


def instantiate(comp: Component, *args: Any) -> Any:
    try:
        return comp.factory(*args)
    except ErdmaError:
        raise  # the component's own, already specific, error
    except Exception as exc:
        raise PluginError(f"{comp.kind} {comp.name!r} from plugin {comp.plugin!r} failed to load: "
                          f"{type(exc).__name__}: {exc}") from exc


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    return None if raw is None else {p.strip() for p in raw.split(",") if p.strip()}


def _listed(group: str) -> list[Any]:
    """The entry points of ``group``, as stevedore lists them (nothing is loaded)."""
    from stevedore import NamedExtensionManager

    return list(NamedExtensionManager(group, names=[], invoke_on_load=False).list_entry_points())


def build_plugin_manager() -> Components:
    """Build a fresh plugin manager: built-ins first, then every allowed entry point, then collect components."""
    from stevedore import NamedExtensionManager

    from . import builtin

    pm = pluggy.PluginManager("erdma")
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="builtin")
    infos = [PluginInfo("builtin", _hooks(builtin))]
    comps = Components(pm, infos)
    allow, deny = _env_list("ERDMA_PLUGINS"), _env_list("ERDMA_DISABLE_PLUGINS") or set()

    def failed(_manager: Any, ep: Any, exc: BaseException) -> None:
        log.warning("erdma plugin %r (%s) failed to load, skipped: %s: %s", ep.name, comps.distribution(ep.name),
                    type(exc).__name__, exc)
        infos.append(PluginInfo(ep.name, (), f"{type(exc).__name__}: {exc}", ep))

    eps = {ep.name: ep for ep in _listed(ENTRY_POINT_GROUP)}
    comps.entry_points = eps
    names = sorted(eps)
    unknown = sorted((allow or set()) - set(names))  # a plugin asked for and missing (disabling one is harmless)
    if unknown:
        raise PluginError(f"ERDMA_PLUGINS={os.environ['ERDMA_PLUGINS']!r} names {', '.join(map(repr, unknown))}, which "
                          f"no installed plugin is; installed plugins: {', '.join(names) or 'none'}"
                          + did_you_mean(unknown[0], names))
    wanted = [n for n in names if (allow is None or n in allow) and n not in deny]
    for skipped in sorted(set(names) - set(wanted)):
        log.info("erdma plugin %r skipped by ERDMA_PLUGINS/ERDMA_DISABLE_PLUGINS", skipped)
    mgr = NamedExtensionManager(ENTRY_POINT_GROUP, wanted, invoke_on_load=False, name_order=True,
                                on_load_failure_callback=failed)
    for ext in mgr.extensions:
        pm.register(ext.plugin, name=ext.name)
        infos.append(PluginInfo(ext.name, _hooks(ext.plugin), None, ext.entry_point))
    pm.check_pending()
    if os.environ.get("ERDMA_TRACE_PLUGINS", "") not in ("", "0"):
        pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[erdma.plugins] {msg}"))
        pm.enable_tracing()
    _collect(pm, comps)
    comps.skipped = set(names) - set(wanted)
    by_module = {ep.value: name for name, ep in eps.items()}
    for ep in _listed(COMPONENTS_GROUP):  # what each installed plugin says it provides
        plugin = by_module.get(ep.value)
        if plugin is not None:
            comps.provided[ep.name] = plugin
    return comps


def _collect(pm: pluggy.PluginManager, comps: Components) -> None:
    from ..wire import codec_id

    current = {"plugin": "builtin"}

    def refused(kind: str, name: str, sdk: int | None) -> bool:
        """Whether a component written for another SDK version is refused (noted, logged). One written for the
        previous version loads through its adapter (``erdma_core.sdk``: its moved names are served from the
        toolkit), as does one of another kind than transport that says no version, as version 1 allowed."""
        if sdk == SDK_VERSION:
            return False
        plugin = current["plugin"]
        dist = comps.distribution(plugin)
        if sdk == SDK_PREVIOUS or (sdk is None and kind != "transport"):
            comps.adapted[kind, name] = SDK_PREVIOUS
            log.info("erdma: %s %r of plugin %r (%s) was written for SDK version %d (%s): it runs through the "
                     "adapter for that version", kind, name, plugin, dist, SDK_PREVIOUS,
                     "it says none" if sdk is None else f"sdk={sdk}")
            return False
        said = "says no SDK version (register(..., sdk=N))" if sdk is None else f"was written for SDK version {sdk}"
        why = (f"{kind} {name!r} of plugin {plugin!r} ({dist}) {said}; this erdma-core ({_version('erdma-core')}) "
               f"provides SDK version {SDK_VERSION} (erdma_core.sdk.VERSION) and, through an adapter, version "
               f"{SDK_PREVIOUS}: install a release of {dist} written for one of them, or, as its author, port it to "
               f"erdma_core.sdk and register it with sdk={SDK_VERSION}")
        comps.refused[kind, name] = why
        log.warning("erdma: refused %s", why)
        return True

    def registrar(kind: str) -> Callable[..., None]:
        def register(name: str, factory: Callable[..., Any], *, options: Mapping[str, Option] | None = None,
                     description: str = "", sdk: int | None = None, check: hookspecs.Check | None = None) -> None:
            if name in comps.by_kind[kind]:
                raise PluginError(f"{kind} {name!r} registered twice: by {comps.by_kind[kind][name].plugin!r} "
                                  f"and {current['plugin']!r}")
            if refused(kind, name, sdk):
                return
            comp = Component(kind, name, factory, current["plugin"], dict(options or {}), description, sdk=sdk,
                             check=check)
            if kind == "compressor":
                cid = codec_id(name)
                other = comps.codecs.get(cid)
                if other is not None or cid == 0:
                    raise PluginError(f"compressor {name!r} of plugin {current['plugin']!r} has codec id {cid:#010x}, "
                                      f"which {'is RAW' if other is None else f'compressor {other.name!r} has'}; rename it")
                comps.codecs[cid] = comp
            comps.by_kind[kind][name] = comp
        return register

    def register_algorithm(op: str, name: str, schedule_fn: Callable[..., Any], *,
                           options: Mapping[str, Option] | None = None, description: str = "",
                           offload: bool = False, sdk: int | None = None, check: hookspecs.Check | None = None) -> None:
        from ..protocol.ops import COLLECTIVES, OFFLOADABLE

        if op not in COLLECTIVES:
            raise PluginError(f"plugin {current['plugin']!r} registered algorithm {name!r} for {op!r}, which is not "
                              f"a collective; valid: {', '.join(COLLECTIVES)}" + did_you_mean(op, COLLECTIVES))
        mine = comps.algorithms.setdefault(op, {})
        if name in mine:
            raise PluginError(f"{op} algorithm {name!r} registered twice: by {mine[name].plugin!r} and "
                              f"{current['plugin']!r}")
        if offload and op not in OFFLOADABLE:
            raise PluginError(f"plugin {current['plugin']!r} registered {op} algorithm {name!r} as an offload; "
                              f"offloads are run for {', '.join(OFFLOADABLE)} only")
        if refused("algorithm", f"{op} {name}", sdk):
            return
        mine[name] = Component("algorithm", name, schedule_fn, current["plugin"], dict(options or {}), description, op,
                               offload, sdk, check)

    def register_env(name: str, description: str) -> None:
        if not name.startswith("ERDMA_"):
            raise PluginError(f"plugin {current['plugin']!r} declared environment variable {name!r}; "
                              "only ERDMA_* names need declaring")
        if name in comps.environment:
            raise PluginError(f"environment variable {name} declared twice: by {comps.environment[name][0]!r} "
                              f"and {current['plugin']!r}")
        comps.environment[name] = (current["plugin"], description)

    hooks = {
        "erdma_register_transports": registrar("transport"),
        "erdma_register_discovery": registrar("discovery"),
        "erdma_register_traversals": registrar("traversal"),
        "erdma_register_compressors": registrar("compressor"),
        "erdma_register_algorithms": register_algorithm,
        "erdma_register_environment": register_env,
    }
    # Call each plugin's implementation separately so every component knows which plugin registered it.
    for plugin_name, plugin in pm.list_name_plugin():
        current["plugin"] = plugin_name or "?"
        others = [p for p in pm.get_plugins() if p is not plugin]
        for hook, register in hooks.items():
            pm.subset_hook_caller(hook, others)(register=register)


def _hooks(plugin: Any) -> tuple[str, ...]:
    return tuple(sorted(n for n in dir(plugin) if n.startswith("erdma_")))


def _owners() -> dict[str, str]:
    """Each plugin entry point's name -> the distribution declaring it, in one pass over the installed
    distributions: each pass reads every distribution's entry points, which costs seconds per pass on a slow
    file system (a guest's 9p share), so it is made once, when a message first needs it
    (``Components.distribution``). Only the few distributions that declare a plugin have their metadata
    parsed."""
    from importlib.metadata import distributions

    owners: dict[str, str] = {}
    for d in distributions():
        mine = [e.name for e in d.entry_points if e.group == ENTRY_POINT_GROUP]
        if mine:
            dist = str(d.metadata["Name"])
            for name in mine:
                owners.setdefault(name, dist)
    return owners


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except (PackageNotFoundError, ValueError):
        return "?"


_CACHE: dict[tuple[str | None, ...], Components] = {}


def components() -> Components:
    """The process-wide components, rebuilt when the plugin env switches change."""
    key = tuple(os.environ.get(v) for v in ("ERDMA_PLUGINS", "ERDMA_DISABLE_PLUGINS", "ERDMA_TRACE_PLUGINS"))
    if key not in _CACHE:
        _CACHE[key] = build_plugin_manager()
    return _CACHE[key]
