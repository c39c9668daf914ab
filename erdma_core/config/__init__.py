"""Config pipeline: declared options, the core schema, and the loader."""

from .load import SHORTHANDS, Config, build, env_name
from .option import Option
from .schema import COLLECTIVE_OPS, core_schema

__all__ = ["COLLECTIVE_OPS", "SHORTHANDS", "Config", "Option", "build", "core_schema", "env_name"]
