"""Build the effective config: embedded defaults < erdma.toml < ERDMA_* environment < explicit arguments.

Environment rule: every key ``section.key`` (and ``section.sub.key``) can be set by
``ERDMA_<SECTION>_<KEY>`` (``ERDMA_<SECTION>_<SUB>_<KEY>``), upper-cased, dots and dashes as underscores;
e.g. ``collectives.chunk_bytes`` <- ``ERDMA_COLLECTIVES_CHUNK_BYTES``. Shorthands: see ``SHORTHANDS``.
"""

from __future__ import annotations

import os
import tomllib
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
}
# ERDMA_* variables that are not config keys.
RESERVED_ENV = {"ERDMA_CONFIG", "ERDMA_PLUGINS", "ERDMA_DISABLE_PLUGINS", "ERDMA_TRACE_PLUGINS", "ERDMA_RUN_ID"}
DEFAULT_FILE = "erdma.toml"

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
) -> Config:
    """Merge defaults, the config file, the environment and ``overrides`` (dotted keys), validating each."""
    environ = os.environ if environ is None else environ
    options = flat_options(schema)
    values = {k: o.default for k, o in options.items()}
    sources = dict.fromkeys(options, "default")

    path = find_file(file, environ)
    if path is not None:
        try:
            table = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        for key, value in _flatten(table, "", options, f"config file {str(path)!r}").items():
            values[key] = options[key].coerce(key, value)
            sources[key] = f"file {path}"

    by_env = {env_name(k): k for k in options} | SHORTHANDS
    for var in sorted(v for v in environ if v.startswith("ERDMA_")):
        if var in RESERVED_ENV or var.startswith("ERDMA_RUN_"):
            continue
        key = by_env.get(var)
        if key is None:
            raise ConfigError(f"environment variable {var}={environ[var]!r} is not a config key; "
                              f"valid names follow ERDMA_<SECTION>_<KEY>" + did_you_mean(var, list(by_env)))
        values[key] = options[key].coerce(key, environ[var], from_text=True)
        sources[key] = f"env {var}"

    for key, value in (overrides or {}).items():
        if key not in options:
            raise ConfigError(f"unknown config key {key!r}" + did_you_mean(key, list(options)))
        values[key] = options[key].coerce(key, value)
        sources[key] = "argument"
    return Config(values, sources, schema)
