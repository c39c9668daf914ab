"""Config pipeline: declared options, the core schema, and the loader."""

from .load import SHORTHANDS, Config, build, env_name
from .option import Option
from .schema import core_schema

__all__ = ["SHORTHANDS", "Config", "Option", "build", "core_schema", "env_name"]
