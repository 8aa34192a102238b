"""Configuration: a TieredPool from a mapping or a JSON / TOML / YAML file, with KVTIER_* overrides.

Owns what a configuration may say, how it is read and checked, and the precedence of its
sources: file or mapping < environment (KVTIER_*) < keyword overrides. It builds the PageFormat
and the TieredPool keyword arguments; it must never create a tier, open a store or touch
memory, and it never guesses: an unknown key, a value of the wrong type or an unknown
KVTIER_* variable raises, naming the key and where it came from (with close matches).

A configuration is a mapping of TieredPool keywords plus a ``format`` table of PageFormat
fields::

    format = {num_layers = 32, num_kv_heads = 8, head_dim = 128, page_size = 16, dtype = "fp8",
              scale = "per_page_head", device_dtype = "bf16"}
    device = "cuda:0"
    host_bytes = "64GiB"
    write_policy = "write_back"
    remote = "/var/lib/kvtier"

Keys are the TieredPool keywords of the installed version (read from its signature), so a
keyword added to the pool is configurable at once. ``remote_<option>`` keys are those the
pool takes; an option of RemoteStore is taken as ``remote_<option>`` when the pool passes
such options through. Keywords that take Python objects (``fmt``, ``transform``,
``registry``, ``device_kv``, ``device_scales``, a callable ``engine`` or a RemoteStore for
``remote``) are keyword overrides only.

Environment: ``KVTIER_<KEY>`` sets a top-level key (``KVTIER_HOST_BYTES=64GiB``,
``KVTIER_REMOTE=/var/lib/kvtier``), ``KVTIER_FORMAT_<FIELD>`` a format field
(``KVTIER_FORMAT_DTYPE=fp8``), ``KVTIER_CONFIG`` names the file read when no configuration
is given. An empty ``KVTIER_REMOTE`` turns the remote tier off.

The cluster tier (Mooncake Store, kvtier.tiers.cluster): ``cluster`` is the mooncake_master's
``host:port``; ``cluster_<field>`` sets a ClusterSettings field (``cluster_metadata_server``,
``cluster_protocol``, ``cluster_segment_bytes``, ...; ``KVTIER_CLUSTER_PROTOCOL=tcp``).

Values: sizes (keys ending in ``_bytes``) take ints or human sizes, "64GiB", "512MiB",
"1.5GB", "4096" (B, KB/MB/GB/TB/PB = powers of 1000, KiB/MiB/GiB/TiB/PiB = powers of
1024, whole bytes); keys ending in ``_s`` take seconds; booleans take true/false, 1/0,
yes/no, on/off; dtypes take kvtier's and the engines' names (see PageFormat).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.format import PageFormat
from kvtier.format.page_format import canonical_dtype

if TYPE_CHECKING:
    from kvtier.pool import TieredPool

ENV_PREFIX = "KVTIER_"
ENV_FORMAT_PREFIX = "KVTIER_FORMAT_"
ENV_CONFIG = "KVTIER_CONFIG"
FILE_SUFFIXES = (".json", ".toml", ".yaml", ".yml")
OBJECT_KEYS = ("fmt", "transform", "registry", "device_kv", "device_scales")
ENGINES = ("auto", "torch", "cuda")

_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgtp", start=1):
    _UNITS[f"{_prefix}b"] = 1000**_power
    _UNITS[f"{_prefix}ib"] = 1024**_power
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

Converter = Callable[[Any, str], Any]


class ConfigError(ValueError):
    """A configuration key or value kvtier cannot use; the message names the key and its source."""


def parse_size(value: int | str, where: str = "size") -> int:
    """Bytes of an int or a human size ("64GiB", "512MiB", "1.5GB", "4096"); `where` names the option."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as 64GiB, 512MiB or 1.5GB, got {value!r}")
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, float):
        number = Decimal(repr(value))
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value)) and match.group(2).lower() in _UNITS:
        number = Decimal(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        raise ConfigError(
            f"{where}: expected a size such as 64GiB, 512MiB or 1.5GB (units {_unit_names()}), got {value!r}"
        )
    if number <= 0 or number != number.to_integral_value():
        raise ConfigError(f"{where}: expected a positive whole number of bytes, got {value!r} = {number} bytes")
    return int(number)


def _unit_names() -> str:
    return ", ".join(u.upper().replace("IB", "iB") for u in _UNITS if u)


# --- value converters: (value, where) -> value ------------------------------------------------
def _integer(minimum: int) -> Converter:
    def convert(value: Any, where: str) -> int:
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{where}: expected an int >= {minimum}, got {value!r}")
        return value

    return convert


def _number(value: Any) -> float | None:
    """A finite float from a number or its text; None for anything else (NaN, inf, bools)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _seconds(value: Any, where: str) -> float:
    number = _number(value)
    if number is None or number < 0:
        raise ConfigError(f"{where}: expected a finite number of seconds >= 0, got {value!r}")
    return number


def _fraction(value: Any, where: str) -> float:
    number = _number(value)
    if number is None or not 0 < number <= 1:
        raise ConfigError(f"{where}: expected a number in (0, 1], got {value!r}")
    return number


def _size(value: Any, where: str) -> int:
    return parse_size(value, where)


def _boolean(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _choice(options: tuple[str, ...]) -> Converter:
    def convert(value: Any, where: str) -> str:
        if value not in options:
            raise ConfigError(f"{where}: expected one of {list(options)}, got {value!r}{_close(value, options)}")
        return value

    return convert


def _string_map(value: Any, where: str) -> dict[str, str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: expected a JSON object of strings, got {value!r} ({err})") from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{where}: expected a mapping of strings to strings, got {value!r}")
    return dict(value)


def _remote(value: Any, where: str) -> str | os.PathLike | None:
    if value is None or value == "":
        return None
    if isinstance(value, (str, os.PathLike)):
        return value
    raise ConfigError(f"{where}: expected a directory or file:// URL (or empty for none), got {value!r}")


def _cluster(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    raise ConfigError(f"{where}: expected the 'host:port' of a mooncake_master (or empty for none), got {value!r}")


def _dtype(value: Any, where: str) -> str:
    try:
        return canonical_dtype(value, where)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _engine(value: Any, where: str) -> str:
    return _choice(ENGINES)(value, where)


def _write_policy(value: Any, where: str) -> str:
    from kvtier.index.write_policy import WRITE_POLICIES

    return _choice(tuple(WRITE_POLICIES))(value, where)


def _eviction(value: Any, where: str) -> str:
    from kvtier.index.eviction import POLICIES

    return _choice(tuple(POLICIES))(value, where)


# Keys whose meaning is not in their name; every other key is typed by its suffix or default.
NAMED: dict[str, Converter] = {
    "device": _text,
    "engine": _engine,
    "write_policy": _write_policy,
    "eviction": _eviction,
    "copy_path": _text,
    "model": _text,
    "name": _text,
    "rank": _integer(0),
    "remote": _remote,
    "cluster": _cluster,
    "remote_backend": _text,
    "remote_backend_params": _string_map,
    "remote_object_prefix": _text,
    "remote_high_watermark": _fraction,
    "remote_low_watermark": _fraction,
}
FORMAT_FIELDS: dict[str, Converter] = {
    "num_layers": _integer(1),
    "num_kv_heads": _integer(1),
    "head_dim": _integer(1),
    "page_size": _integer(1),
    "dtype": _dtype,
    "device_dtype": _dtype,
    "scale": _text,
    "layout": _text,
    "mla": _boolean,
    "allow_unscaled_fp8": _boolean,
}


def _by_suffix(name: str, default: Any) -> Converter | None:
    """The converter a keyword's name or default implies; None for a keyword that takes an object."""
    if name.endswith("_bytes"):
        return _size
    if name.endswith("_s"):
        return _seconds
    if name.endswith(("_pages", "_depth", "_threads")) or (isinstance(default, int) and not isinstance(default, bool)):
        return _integer(1)
    if isinstance(default, bool):
        return _boolean
    if isinstance(default, float):
        return _seconds
    if isinstance(default, str):
        return _text
    return None


def _close(word: Any, options) -> str:
    if not isinstance(word, str):
        return ""
    near = difflib.get_close_matches(word, list(options), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""


# --- the schema of the installed pool ---------------------------------------------------------
def _parameters(function) -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(function).parameters)
    params.pop("self", None)
    return params


def pool_options() -> dict[str, Converter]:
    """Every key a configuration file may set, with its converter, for the installed TieredPool."""
    from kvtier.pool import TieredPool
    from kvtier.tiers.remote import RemoteStore

    pool = _parameters(TieredPool.__init__)
    store = _parameters(RemoteStore.__init__)
    options: dict[str, Converter] = {}
    for name, param in pool.items():
        if name in OBJECT_KEYS or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        convert = NAMED.get(name) or _by_suffix(name, param.default)
        if convert is not None:
            options[name] = convert
    if any(p.kind is p.VAR_KEYWORD for p in pool.values()):
        # The pool passes remote_<option> through to the store it opens.
        for name, param in store.items():
            key = f"remote_{name}"
            if param.kind is param.KEYWORD_ONLY and key not in options and name not in ("namespace", "page_bytes"):
                convert = NAMED.get(key) or _by_suffix(name, param.default)
                if convert is not None:
                    options[key] = convert
    # The cluster tier's settings (kvtier.tiers.cluster.ClusterSettings) as cluster_<field>;
    # pool_kwargs folds them into the pool's one `cluster` keyword.
    from kvtier.tiers.cluster.settings import ClusterSettings

    for field in dataclasses.fields(ClusterSettings):
        if field.name not in ("master", "mac_key"):
            options[f"cluster_{field.name}"] = _by_suffix(field.name, field.default)
    return options


def _fold_cluster(kwargs: dict[str, Any], where: str) -> None:
    """cluster_<field> keys into the pool's `cluster` keyword (a mapping of ClusterSettings fields)."""
    fields = {key[len("cluster_"):]: kwargs.pop(key) for key in [k for k in kwargs if k.startswith("cluster_")]}
    if not fields:
        return
    if kwargs.get("cluster") is None:
        raise ConfigError(f"{where}: cluster_{sorted(fields)[0]} is set but 'cluster' (the mooncake_master address) is not")
    if isinstance(kwargs["cluster"], str):
        kwargs["cluster"] = {"master": kwargs["cluster"], **fields}


def _unknown(key: str, where: str, options: Mapping[str, Converter]) -> ConfigError:
    if key in OBJECT_KEYS:
        return ConfigError(f"{where}: {key!r} takes a Python object; pass it as a keyword to pool_from_config")
    if key.startswith("remote_"):
        from kvtier.tiers.remote import RemoteStore

        if key[len("remote_") :] in _parameters(RemoteStore.__init__):
            return ConfigError(
                f"{where}: RemoteStore takes {key[len('remote_'):]!r}, but this TieredPool does not pass "
                f"{key!r} through; remote options it takes: {sorted(k for k in options if k.startswith('remote_'))}"
            )
    return ConfigError(f"{where}: unknown key{_close(key, options)}; keys: {sorted(options)} and 'format'")


# --- sources --------------------------------------------------------------------------------
def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping in a JSON, TOML or YAML file (YAML needs PyYAML)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ConfigError(f"config file {str(path)!r}: expected one of {list(FILE_SUFFIXES)}, got suffix {suffix!r}")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        parse, errors = json.loads, (json.JSONDecodeError,)
    elif suffix == ".toml":
        toml = _toml()
        parse, errors = toml.loads, (toml.TOMLDecodeError,)
    else:
        yaml = _yaml()
        parse, errors = yaml.safe_load, (yaml.YAMLError,)
    try:
        data = parse(text)
    except errors as err:
        raise ConfigError(f"config file {str(path)!r} is not valid {suffix[1:].upper()}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top, got {type(data).__name__}")
    return data


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError("reading a TOML config on Python 3.10 needs tomli: pip install tomli") from None
    return tomllib


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ConfigError("reading a YAML config needs PyYAML: pip install 'kvtier[yaml]' (or pyyaml)") from None
    return yaml


def _environment(options: Mapping[str, Converter]) -> tuple[dict[str, str], dict[str, str]]:
    """(top-level keys, format fields) set by KVTIER_* variables, each mapped to its variable."""
    top: dict[str, str] = {}
    fmt: dict[str, str] = {}
    for var in sorted(os.environ):
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG:
            continue
        if var.startswith(ENV_FORMAT_PREFIX):
            field = var[len(ENV_FORMAT_PREFIX) :].lower()
            if field not in FORMAT_FIELDS:
                known = [ENV_FORMAT_PREFIX + f.upper() for f in FORMAT_FIELDS]
                raise ConfigError(f"environment: unknown variable {var}{_close(var, known)}; format fields: {known}")
            fmt[field] = var
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key not in options:
            known = [ENV_PREFIX + k.upper() for k in options]
            raise ConfigError(
                f"environment: unknown variable {var}{_close(var, known)}; kvtier reads {ENV_CONFIG}, "
                f"{ENV_FORMAT_PREFIX}<FIELD> and {sorted(known)}"
            )
        top[key] = var
    return top, fmt


# --- building --------------------------------------------------------------------------------
def _format(section: Any, env: Mapping[str, str], where: str) -> PageFormat:
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where} 'format': expected a table of PageFormat fields, got {section!r}")
    fields: dict[str, Any] = {}
    for field, value in section.items():
        if field not in FORMAT_FIELDS:
            raise ConfigError(
                f"{where} 'format.{field}': unknown PageFormat field{_close(field, FORMAT_FIELDS)}; "
                f"fields: {list(FORMAT_FIELDS)}"
            )
        fields[field] = FORMAT_FIELDS[field](value, f"{where} 'format.{field}'")
    for field, var in env.items():
        fields[field] = FORMAT_FIELDS[field](os.environ[var], var)
    required = [f.name for f in dataclasses.fields(PageFormat) if f.init and f.default is dataclasses.MISSING]
    missing = [f for f in required if f not in fields]
    if missing:
        raise ConfigError(f"{where} 'format': missing {missing} (PageFormat needs {required})")
    try:
        return PageFormat(**fields)
    except ValueError as err:
        raise ConfigError(f"{where} 'format': {err}") from None


def pool_kwargs(config: Mapping[str, Any] | str | os.PathLike | None = None, **overrides: Any) -> dict[str, Any]:
    """The TieredPool keyword arguments (``fmt`` included) a configuration describes.

    config: a mapping, a path to a .json / .toml / .yaml file, or None for the file named by
    KVTIER_CONFIG (or nothing but the environment and the overrides). KVTIER_* variables
    override the configuration; keyword overrides (objects included) override both.
    """
    options = pool_options()
    if config is None and os.environ.get(ENV_CONFIG):
        config = os.environ[ENV_CONFIG]
    if config is None:
        data, where = {}, "config"
    elif isinstance(config, Mapping):
        data, where = dict(config), "config key"
    elif isinstance(config, (str, os.PathLike)):
        data, where = read_config(config), f"{os.fspath(config)}:"
    else:
        raise ConfigError(f"config: expected a mapping, a file path or None, got {type(config).__name__}")
    env_top, env_format = _environment(options)
    kwargs: dict[str, Any] = {}
    section = data.pop("format", None)
    for key, value in data.items():
        if not isinstance(key, str) or key not in options:
            raise _unknown(str(key), f"{where} {key!r}", options)
        kwargs[key] = options[key](value, f"{where} {key!r}")
    for key, var in env_top.items():
        kwargs[key] = options[key](os.environ[var], var)
    for key, value in overrides.items():
        if key in OBJECT_KEYS or key == "engine" and callable(value):
            kwargs[key] = value
        elif key == "remote" and value is not None and not isinstance(value, (str, os.PathLike)):
            kwargs[key] = value  # a RemoteStore the caller owns
        elif key == "cluster" and value is not None and not isinstance(value, str):
            kwargs[key] = value  # ClusterSettings or a mapping of its fields
        elif key in options:
            kwargs[key] = options[key](value, f"keyword {key!r}")
        else:
            raise _unknown(key, f"keyword {key!r}", options)
    _fold_cluster(kwargs, where)
    if "fmt" not in kwargs:
        if section is None and not env_format:
            raise ConfigError(f"{where} 'format' is missing: give a format table or pass fmt=PageFormat(...)")
        kwargs["fmt"] = _format(section if section is not None else {}, env_format, where)
    elif section is not None or env_format:
        raise ConfigError(f"{where} 'format' and the keyword fmt both describe the page format; give one")
    return kwargs


def cluster_from_environment() -> dict[str, Any] | None:
    """The cluster tier's keys set by ``KVTIER_CLUSTER`` and ``KVTIER_CLUSTER_<SETTING>``, folded as
    pool_kwargs folds them (None without ``KVTIER_CLUSTER``), for a reader that builds stores
    without a pool (the SGLang backend); other KVTIER_* variables are not its business."""
    options = pool_options()
    kwargs: dict[str, Any] = {}
    for var in sorted(os.environ):
        if var.startswith(ENV_PREFIX + "CLUSTER"):
            key = var[len(ENV_PREFIX) :].lower()
            if key not in options:
                raise _unknown(key, f"environment {var}", options)
            kwargs[key] = options[key](os.environ[var], var)
    _fold_cluster(kwargs, "environment")
    return kwargs.get("cluster")


def pool_from_config(config: Mapping[str, Any] | str | os.PathLike | None = None, **overrides: Any) -> TieredPool:
    """A TieredPool from a configuration (see pool_kwargs), with keyword overrides on top."""
    from kvtier.pool import TieredPool

    return TieredPool(**pool_kwargs(config, **overrides))
