"""The version of the plugin SDK (``erdma_core.sdk``): what a plugin's ``register(..., sdk=N)`` is checked
against. It goes up when a name of the SDK is removed or changes its meaning; adding a name keeps it. The
core keeps an adapter for the version before (``PREVIOUS``): a component written for it still loads."""

VERSION = 2
PREVIOUS = 1
