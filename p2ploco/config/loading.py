"""A config from YAML and ``--set key=value`` overrides: each setting refused as it is read where its key is unknown,
a section is set as a value or its value has the wrong type (``settings_of``), and once the config is built where a
value is out of bounds or a rule between keys is broken (``built``)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic.type_adapter import TypeAdapter

from p2ploco.config.fields import STRICT, OutOfBounds, Section
from p2ploco.config.sections import Config
from p2ploco.errors import ConfigError

Setting = tuple[tuple[str, ...], Any]  # a key's path and the value set for it


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Build a validated Config from an optional YAML file and ``key=value`` overrides."""
    from_file = [] if path is None else [setting for key, value in _read_yaml(Path(path)).items()
                                         for setting in settings_of(str(key), value, source=str(path))]
    return built(Config(), from_file + override_settings(overrides))


def with_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """A validated copy of ``config`` with ``key=value`` overrides applied (as ``--set`` does)."""
    return built(config, override_settings(overrides))




def keys_set(overrides: Sequence[str]) -> frozenset[str]:
    """The dotted keys ``key=value`` overrides set (each key of a section set as a mapping); ConfigError as
    ``load_config`` gives for one that sets none."""
    return frozenset(".".join(path) for path, _ in override_settings(overrides))


def override_settings(overrides: Sequence[str]) -> list[Setting]:
    settings = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set inner.lr=3e-4")
        settings += settings_of(key.strip(), _parse_scalar(raw), source="--set")
    return settings


def settings_of(dotted_key: str, value: Any, source: str) -> list[Setting]:
    """What setting ``dotted_key`` (``inner.lr``) to ``value`` sets: that key, or each key of a mapping set for a
    section. Refuses, naming ``source``, a key no section has, a section given a value, a value given keys, and a
    value of the wrong type (its bounds are checked once the whole config is built)."""
    path = tuple(dotted_key.split("."))
    section: type[Section] | None = Config
    for depth, name in enumerate(path):
        if section is None:
            raise ConfigError(f"{source}: '{'.'.join(path[:depth])}' is a value, not a section")
        if name not in section.model_fields:
            prefix = ".".join(path[:depth])
            known = [f"{prefix}.{n}" if prefix else n for n in section.model_fields]
            raise ConfigError(f"{source}: unknown config key '{dotted_key}'{_suggest(dotted_key, known)}")
        field = section.model_fields[name]
        section = _section_of(field.annotation)
    if section is not None:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{dotted_key}' is a section, not a value: set its keys "
                              f"({dotted_key}.KEY=VALUE, or a mapping under {dotted_key}: in YAML)")
        return [setting for key, item in value.items() for setting in settings_of(f"{dotted_key}.{key}", item, source)]
    _check_type(field, value, f"{source}: {dotted_key}")
    return [(path, value)]


def _section_of(annotation: Any) -> type[Section] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


WRONG_TYPE = {"float_type": "must be a number", "finite_number": "must be a finite number",
              "int_type": "must be an integer", "bool_type": "must be true or false",
              "string_type": "must be a string", "list_type": "must be a list, e.g. [a, b]"}


def _check_type(field: FieldInfo, value: Any, where: str) -> None:
    """ConfigError if ``value`` does not have ``field``'s type, naming the value (or the item of a list) that does
    not; a value out of the field's bounds passes here."""
    try:
        TypeAdapter(field.rebuild_annotation(), config=STRICT).validate_python(value)
    except ValidationError as e:
        for error in e.errors():
            if error["type"] == "literal_error":
                raise ConfigError(f"{where} must be one of {', '.join(map(str, get_args(field.annotation)))}; "
                                  f"got {error['input']!r}") from None
            if error["type"] in WRONG_TYPE:
                raise ConfigError(f"{where} {WRONG_TYPE[error['type']]}; got {error['input']!r}") from None


def built(base: Config, settings: list[Setting]) -> Config:
    """``base`` with ``settings`` (each of its key's type) applied; ConfigError with one line for the first value
    out of its bounds or rule between keys broken, in the order the sections are checked."""
    tree = base.model_dump()
    for path, value in settings:
        node = tree
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = value
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        error = e.errors()[0]
        broken = error["ctx"]["error"]
        if isinstance(broken, OutOfBounds):
            key = ".".join(part for part in error["loc"] if isinstance(part, str))
            raise ConfigError(broken.line.format(key=key, value=broken.value)) from None
        raise ConfigError(str(broken)) from None  # a rule between keys, from a section's model validator


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, inner:, ...)")
    return data


def _parse_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f"; known keys here: {', '.join(known)}"
