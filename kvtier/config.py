"""Configuration: a TieredPool from a mapping or a JSON / TOML / YAML file, with KVTIER_* overrides.

Owns what a configuration may say, how it is read and checked, and the precedence of its
sources: file or mapping < environment (KVTIER_*) < keyword overrides. It builds the PageFormat
and the TieredPool keyword arguments, and the pools themselves (``pool_from_config``): the pool
never reads configuration. It must never create a tier, open a store or touch memory itself,
and it never guesses: an unknown key or a value of the wrong type raises, naming the key and
where it came from (with close matches). An unknown KVTIER_* variable is logged once, with
close matches, and raises only when the configuration is strict (``strict = true``,
``KVTIER_STRICT=1`` or the keyword ``strict=True``): a variable meant for another version of
kvtier, or for its test suite, must not stop a server.

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
is given, ``KVTIER_STRICT`` makes unknown variables errors. An empty ``KVTIER_REMOTE`` turns
the remote tier off. ``KVTIER_LOG_LEVEL`` is read at ``import kvtier`` (kvtier.log).

Checks across keys: ``host_bytes`` and ``host_pages`` from one source are refused (one would
be ignored; a later source's one replaces an earlier source's other); a CUDA ``copy_path``
with a device that is not CUDA is refused (it would never be used); ``remote_capacity_bytes``
must hold at least one page of the format.

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
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import SettingError
from kvtier.format import PageFormat
from kvtier.format.page_format import canonical_dtype
from kvtier.log import LOG_LEVEL_VAR
from kvtier.pool.checks import COPY_PATHS, CUDA_COPY_PATHS

if TYPE_CHECKING:
    from kvtier.pool import TieredPool

ENV_PREFIX = "KVTIER_"
ENV_FORMAT_PREFIX = "KVTIER_FORMAT_"
ENV_CONFIG = "KVTIER_CONFIG"
ENV_STRICT = "KVTIER_STRICT"
# Variables kvtier reads that are not configuration keys (KVTIER_REQUIRE_SGLANG: its test suite).
ENV_OTHER = (ENV_CONFIG, ENV_STRICT, LOG_LEVEL_VAR, "KVTIER_REQUIRE_SGLANG")
CONFIG_ONLY_KEYS = ("strict",)
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
log = logging.getLogger(__name__)
_warned: set[str] = set()  # unknown KVTIER_* variables already logged by this process


class ConfigError(SettingError):
    """A configuration key or value kvtier cannot use; the message names the key and its source."""


class MissingFormat(ConfigError):
    """No source gave the page format (a ``format`` table, KVTIER_FORMAT_* or ``fmt=``)."""


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
    "copy_path": _choice(COPY_PATHS),
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
    near = _close(key, [*options, *CONFIG_ONLY_KEYS])
    return ConfigError(f"{where}: unknown key{near}; keys: {sorted(options)}, 'format' and 'strict'")


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


def _environment(options: Mapping[str, Converter], strict: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(top-level keys, format fields) set by KVTIER_* variables, each mapped to its variable.

    An unknown variable is logged once a process with its close matches, or raises if strict."""
    top: dict[str, str] = {}
    fmt: dict[str, str] = {}
    for var in sorted(os.environ):
        if not var.startswith(ENV_PREFIX) or var in ENV_OTHER:
            continue
        if var.startswith(ENV_FORMAT_PREFIX):
            field = var[len(ENV_FORMAT_PREFIX) :].lower()
            if field in FORMAT_FIELDS:
                fmt[field] = var
                continue
            known = [ENV_FORMAT_PREFIX + f.upper() for f in FORMAT_FIELDS]
            _unknown_variable(var, f"{_close(var, known)}; format fields: {known}", strict)
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key in options:
            top[key] = var
            continue
        known = [ENV_PREFIX + k.upper() for k in [*options, *CONFIG_ONLY_KEYS]] + list(ENV_OTHER)
        near = _close(var, known)
        _unknown_variable(var, near or f"; kvtier reads {', '.join(ENV_OTHER[:3])}, {ENV_FORMAT_PREFIX}<FIELD> and "
                                       f"{ENV_PREFIX}<KEY> for the configuration keys {sorted(options)}", strict)
    return top, fmt


def _unknown_variable(var: str, detail: str, strict: bool) -> None:
    if strict:
        raise ConfigError(f"environment: unknown variable {var}{detail} (strict: unset it, or drop strict)")
    if var not in _warned:
        _warned.add(var)
        log.warning("environment: kvtier ignores the unknown variable %s%s", var, detail)


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


def _settings(
    config: Mapping[str, Any] | str | os.PathLike | None, options: Mapping[str, Converter], overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str], Any, dict[str, str], str]:
    """(checked keyword arguments, where each came from, the raw format section, format fields
    from KVTIER_FORMAT_*, the source's name): a configuration read in the order file or mapping <
    environment < keyword overrides."""
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
    strict = _strict(data, where, overrides)
    env_top, env_format = _environment(options, strict)
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}  # key -> where its value came from
    section = data.pop("format", None)
    layers = (
        (where, [(key, value, f"{where} {key!r}") for key, value in data.items()]),
        ("the environment", [(key, os.environ[var], var) for key, var in env_top.items()]),
        ("the keywords", [(key, value, f"keyword {key!r}") for key, value in overrides.items()]),
    )
    for source, layer in layers:
        for key, value, named in layer:
            keyword = source == "the keywords"
            if keyword and (key in OBJECT_KEYS or key == "engine" and callable(value)):
                kwargs[key] = value
            elif keyword and key == "remote" and value is not None and not isinstance(value, (str, os.PathLike)):
                kwargs[key] = value  # a RemoteStore the caller owns
            elif keyword and key == "cluster" and value is not None and not isinstance(value, str):
                kwargs[key] = value  # ClusterSettings or a mapping of its fields
            elif isinstance(key, str) and key in options:
                kwargs[key] = options[key](value, named)
            else:
                raise _unknown(str(key), named, options)
            sources[key] = named
        _one_host_size(kwargs, sources, {key for key, *_ in layer}, source)
    _fold_cluster(kwargs, where)
    return kwargs, sources, section, env_format, where


def pool_kwargs(config: Mapping[str, Any] | str | os.PathLike | None = None, **overrides: Any) -> dict[str, Any]:
    """The TieredPool keyword arguments (``fmt`` included) a configuration describes.

    config: a mapping, a path to a .json / .toml / .yaml file, or None for the file named by
    KVTIER_CONFIG (or nothing but the environment and the overrides). KVTIER_* variables
    override the configuration; keyword overrides (objects included) override both. The key
    ``strict`` (also KVTIER_STRICT, or the keyword) makes unknown KVTIER_* variables errors.
    """
    kwargs, sources, section, env_format, where = _settings(config, pool_options(), overrides)
    if "fmt" not in kwargs:
        if section is None and not env_format:
            raise MissingFormat(
                f"{where} 'format' is missing: give a format table (num_layers, num_kv_heads, head_dim, page_size, "
                f"dtype), {ENV_FORMAT_PREFIX}<FIELD> variables, or the keyword fmt=PageFormat(...)"
            )
        kwargs["fmt"] = _format(section if section is not None else {}, env_format, where)
    elif section is not None or env_format:
        raise ConfigError(f"{where} 'format' and the keyword fmt both describe the page format; give one")
    _check_across(kwargs, sources)
    return kwargs


def store_options() -> dict[str, Converter]:
    """``remote`` and every RemoteStore option as ``remote_<option>``, with its converter."""
    from kvtier.tiers.remote import RemoteStore

    options: dict[str, Converter] = {"remote": _remote}
    for name, param in _parameters(RemoteStore.__init__).items():
        if param.kind is param.KEYWORD_ONLY and name not in ("namespace", "page_bytes", "namespace_label"):
            key = f"remote_{name}"
            convert = NAMED.get(key) or _by_suffix(name, param.default)
            if convert is not None:
                options[key] = convert
    return options


def store_kwargs(
    config: Mapping[str, Any] | str | os.PathLike | None = None, **overrides: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(store settings, other settings) of a configuration, for a caller that opens the remote
    store itself and whose engine owns the device and host tiers (the SGLang backend).

    The same vocabulary, sources and precedence as ``pool_kwargs``, plus every RemoteStore
    option as ``remote_<option>``. The first mapping holds ``remote`` (the location) and the
    store's keyword arguments by RemoteStore's own names (``remote_timeout_s`` -> ``timeout_s``);
    the second the pool's keys, checked (a format table too, when given), which such a caller
    does not use."""
    stores = store_options()
    kwargs, _, section, env_format, where = _settings(config, {**pool_options(), **stores}, overrides)
    if section is not None or env_format:
        kwargs["format"] = _format(section if section is not None else {}, env_format, where)
    store = {"remote": kwargs.pop("remote", None)}
    for key in [k for k in kwargs if k in stores]:
        store[key[len("remote_") :]] = kwargs.pop(key)
    return store, kwargs


def _strict(data: dict, where: str, overrides: dict) -> bool:
    """Whether unknown KVTIER_* variables are errors; takes ``strict`` out of data and overrides."""
    strict = False
    if "strict" in data:
        strict = _boolean(data.pop("strict"), f"{where} 'strict'")
    if os.environ.get(ENV_STRICT, "").strip():
        strict = _boolean(os.environ[ENV_STRICT], ENV_STRICT)
    if "strict" in overrides:
        strict = _boolean(overrides.pop("strict"), "keyword 'strict'")
    return strict


def _one_host_size(kwargs: dict, sources: dict, given: set, source: str) -> None:
    """host_bytes and host_pages size the same tier: one source may give one of them; a later
    source's one replaces an earlier source's other."""
    if {"host_bytes", "host_pages"} <= given:
        raise ConfigError(
            f"{sources['host_bytes']} = {kwargs['host_bytes']} and {sources['host_pages']} = {kwargs['host_pages']} "
            f"both size the host tier (from {source}); give one: host_bytes for a size, host_pages for a page count"
        )
    for key, other in (("host_bytes", "host_pages"), ("host_pages", "host_bytes")):
        if key in given and other in kwargs:
            del kwargs[other], sources[other]


def _check_across(kwargs: dict, sources: dict) -> None:
    """Checks of one key against another, or against the page format."""
    copy_path = kwargs.get("copy_path")
    if copy_path in CUDA_COPY_PATHS and "device_kv" not in kwargs:
        device, engine = kwargs.get("device", "cpu"), kwargs.get("engine", "auto")
        cuda_device = isinstance(device, str) and device.strip().lower().startswith("cuda")
        if engine == "torch" or (engine == "auto" and not cuda_device):
            why = "engine = 'torch' copies with torch" if engine == "torch" else (
                f"device = {device!r}" + ("" if "device" in sources else " (the default)") + " is not a CUDA device"
            )
            raise ConfigError(
                f"{sources['copy_path']} = {copy_path!r} moves bytes with CUDA, but {why}, so it would never be used: "
                "use copy_path = 'auto' (or 'torch'), or device = 'cuda' with engine 'auto' or 'cuda'"
            )
    capacity = kwargs.get("remote_capacity_bytes")
    if capacity is not None and capacity < kwargs["fmt"].page_bytes:
        fmt = kwargs["fmt"]
        raise ConfigError(
            f"{sources['remote_capacity_bytes']} = {capacity} bytes holds no page: a page of {fmt.describe()} "
            f"is {fmt.page_bytes} bytes; give at least that (e.g. \"64GiB\") or leave it out (half the free disk)"
        )


def pool_from_config(config: Mapping[str, Any] | str | os.PathLike | None = None, **overrides: Any) -> TieredPool:
    """A TieredPool from a configuration (see pool_kwargs), with keyword overrides on top."""
    from kvtier.pool import TieredPool

    return TieredPool(**pool_kwargs(config, **overrides))
