"""Build the effective config: embedded defaults < erdma.toml < ERDMA_* environment < explicit arguments.

Environment rule: every key ``section.key`` (and ``section.sub.key``) can be set by
``ERDMA_<SECTION>_<KEY>`` (``ERDMA_<SECTION>_<SUB>_<KEY>``), upper-cased, dots and dashes as underscores;
e.g. ``collectives.chunk_bytes`` <- ``ERDMA_COLLECTIVES_CHUNK_BYTES``. Shorthands (``SHORTHANDS``) set the
most used keys in fewer letters; when a shorthand and the long name of the same key are both set, the long
name wins, and if their values differ a ``ConfigWarning`` says so. Any other ``ERDMA_*`` variable must be
declared by the core or a plugin (``erdma_register_environment``), else it is an error naming it. A variable
set to the empty string is unset.
"""

from __future__ import annotations

import logging
import os
import tomllib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .option import Option, did_you_mean

SHORTHANDS = {
    "ERDMA_TRANSPORT": "transport.name",
    "ERDMA_ALGORITHM": "collectives.allreduce",
    "ERDMA_COMPRESSION": "compression.name",
    "ERDMA_TRAVERSAL": "traversal.name",
    "ERDMA_TIMEOUT": "timeouts.collective",
    "ERDMA_INIT_METHOD": "discovery.init_method",
    "ERDMA_SECRET": "security.secret",
}
DEFAULT_FILE = "erdma.toml"
log = logging.getLogger("erdma.config")


class ConfigWarning(UserWarning):
    """Two settings of the same key disagree (a shorthand and its long name)."""

Schema = Mapping[str, Mapping[str, Option]]


def env_name(key: str) -> str:
    return "ERDMA_" + key.upper().replace(".", "_").replace("-", "_")


class Config:
    """The effective config: ``config["transport.name"]``, ``config.section("transport.tcp")``, sources."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str], schema: Schema) -> None:
        self._values = values
        self.sources = sources
        self.schema = schema

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def section(self, name: str) -> dict[str, Any]:
        prefix = name + "."
        return {k[len(prefix):]: v for k, v in self._values.items() if k.startswith(prefix) and "." not in k[len(prefix):]}

    def shown(self, key: str) -> str:
        """How ``key``'s value is printed: a secret option's value is never shown, only whether it is set."""
        section, _, name = key.rpartition(".")
        opt = self.schema.get(section, {}).get(name)
        value = self._values[key]
        return ("'<set>'" if value else "''") if opt is not None and opt.secret else repr(value)

    def items(self) -> list[tuple[str, Any, str]]:
        return [(k, self._values[k], self.sources[k]) for k in sorted(self._values)]

    def to_env(self) -> dict[str, str]:
        """Every non-default value as ERDMA_* variables (how ``erdma run`` hands the config to ranks)."""
        out = {}
        for key, value, source in self.items():
            if source != "default":
                out[env_name(key)] = str(value).lower() if isinstance(value, bool) else str(value)
        return out


def flat_options(schema: Schema) -> dict[str, Option]:
    return {f"{section}.{key}": opt for section, opts in schema.items() for key, opt in opts.items()}


def _flatten(table: Mapping[str, Any], prefix: str, options: Mapping[str, Option], origin: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path not in options:
            if not any(o.startswith(path + ".") for o in options):
                sections = sorted({o.rsplit(".", 1)[0] for o in options})
                raise ConfigError(f"{origin}: unknown section [{path}]; valid sections: {', '.join(sections)}"
                                  + did_you_mean(path, sections))
            out |= _flatten(value, path + ".", options, origin)
        elif path not in options:
            section = prefix.rstrip(".")
            valid = sorted(o[len(prefix):] for o in options if o.startswith(prefix) and "." not in o[len(prefix):])
            raise ConfigError(f"{origin}: unknown key {path!r} in [{section or 'top level'}]; valid keys: "
                              f"{', '.join(valid) or '(none)'}" + did_you_mean(key, valid))
        else:
            out[path] = value
    return out


def find_file(explicit: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path | None:
    if explicit is not None:
        path = Path(explicit)
    elif environ.get("ERDMA_CONFIG"):
        path = Path(environ["ERDMA_CONFIG"])
    elif Path(DEFAULT_FILE).is_file():
        return Path(DEFAULT_FILE)
    else:
        return None
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist (from {'argument' if explicit else 'ERDMA_CONFIG'})")
    return path


def build(
    schema: Schema,
    *,
    file: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    declared_env: Mapping[str, str] | None = None,
) -> Config:
    """Merge defaults, the config file, the environment and ``overrides`` (dotted keys), validating each.
    ``declared_env``: ``ERDMA_*`` variables that are not config keys but are read by the core or a plugin."""
    environ = os.environ if environ is None else environ
    options = flat_options(schema)
    values = {k: o.default for k, o in options.items()}
    sources = dict.fromkeys(options, "default")

    path = find_file(file, environ)
    if path is not None:
        origin = f"config file {str(path)!r}"
        try:
            table = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{origin} is not valid TOML: {exc}") from None
        for key, value in _flatten(table, "", options, origin).items():
            values[key] = _coerce(options[key], key, value, origin)
            sources[key] = f"file {path}"

    long_names = {env_name(k): k for k in options}
    declared = set(declared_env or ())
    from_env: dict[str, str] = {}  # key -> the variable that set it
    # an empty value is unset (``ERDMA_COMPRESSION_NAME= cmd`` as ``unset``); shorthands first: long names win
    for var in sorted(v for v in environ if v.startswith("ERDMA_") and environ[v] != ""):
        key = SHORTHANDS.get(var) or long_names.get(var) or ""
        if not key:
            if var in declared:
                continue
            raise ConfigError(f"environment variable {var}={environ[var]!r} is not a config key and no installed "
                              "plugin declares it; config keys follow ERDMA_<SECTION>_<KEY>"
                              + did_you_mean(var, [*long_names, *SHORTHANDS, *declared]))
        if key not in options:
            continue
        value = _coerce(options[key], key, environ[var], f"environment variable {var}", from_text=True)
        earlier = from_env.get(key)
        if earlier is not None:
            long_var, short_var = (var, earlier) if var in long_names else (earlier, var)
            if environ[long_var] != environ[short_var]:
                msg = (f"{short_var}={environ[short_var]!r} and {long_var}={environ[long_var]!r} both set "
                       f"{key!r}; the long name wins")
                warnings.warn(msg, ConfigWarning, stacklevel=3)
                log.warning("%s", msg)
            if var not in long_names:
                continue  # the shorthand never overrides its long name
        values[key] = value
        sources[key] = f"env {var}"
        from_env[key] = var

    for key, value in (overrides or {}).items():
        if key not in options:
            raise ConfigError(f"unknown config key {key!r}" + did_you_mean(key, list(options)))
        values[key] = _coerce(options[key], key, value, "argument")
        sources[key] = "argument"
    return Config(values, sources, schema)


def _coerce(option: Option, key: str, value: Any, origin: str, *, from_text: bool = False) -> Any:
    """``option.coerce``, with the error saying where the bad value came from."""
    try:
        return option.coerce(key, value, from_text=from_text)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
