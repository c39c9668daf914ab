"""Plugin machinery: the hook specs, loading through entry points, and the core's own registrations."""

from .manager import Component, Components, PluginInfo, build_plugin_manager, components

__all__ = ["Component", "Components", "PluginInfo", "build_plugin_manager", "components"]
