"""From a TOML file and the command line to one typed :class:`JobConfig`, and back to TOML.

Precedence: defaults < TOML file < ``--mesh`` < ``--section.key`` overrides. Every user mistake
raises :class:`ConfigError` naming the key and the fix, before any process group exists: a bad
config must fail in seconds, never hang a collective.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Any

import tomli_w

from trainer.config.dependent_settings import check_dependent_settings
from trainer.config.fields import FloatList, StrList, type_name
from trainer.config.foreign_keys import instead_of
from trainer.config.schema import FIELDS, JobConfig
from trainer.config.validate import validate
from trainer.runtime.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
CONFIG_DIR = REPO_ROOT / "train_configs"
DEFAULT_CONFIG = CONFIG_DIR / "debug_model.toml"
BOOL_WORDS = ("true", "false")


MESH_DIMS = {
    "pp": "pipeline_parallel_degree",
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "tp": "tensor_parallel_degree",
    "cp": "context_parallel_degree",
    "ep": "expert_parallel_degree",
}
"""``--mesh``'s dimension names and the `parallelism` fields they set."""


def resolve_path(path: str) -> str:
    """A relative path that does not exist from the working directory is tried from the repo root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists() or not (REPO_ROOT / candidate).exists():
        return str(candidate)
    return str(REPO_ROOT / candidate)


HINT_CUTOFF = 0.8
"""How alike (difflib's ratio) a key must be to be offered for an unknown one: typos score 0.84
and more (`training.batch_size` for `training.local_batch_size`); below, unrelated keys of a
shared section do (`moe.aux_loss_coeff` and `moe.balance_loss_scope`: 0.7)."""


def _unknown_key(key: str) -> ConfigError:
    """What we do instead, for another trainer's key; else the same name in another section
    (`training.lr`), a `--mesh` dimension's key, or a close spelling; else the pointer to --help."""
    instead = instead_of(key)
    if instead is not None:
        return ConfigError(f"unknown config key `{key}`: {instead}.")
    name = key.rsplit(".", 1)[-1].replace("-", "_")
    if name in MESH_DIMS:
        return ConfigError(
            f"unknown config key `{key}`. Did you mean `parallelism.{MESH_DIMS[name]}` (or `--mesh {name}=N`)?"
        )
    elsewhere = [field for field in FIELDS if field.split(".")[1] == name]
    close = elsewhere or difflib.get_close_matches(key, FIELDS, n=1, cutoff=HINT_CUTOFF)
    hint = f" Did you mean `{close[0]}`?" if close else " Run with --help for the list of keys."
    return ConfigError(f"unknown config key `{key}`.{hint}")


def _coerce(key: str, value: Any, from_cli: bool) -> Any:
    """Convert ``value`` to the declared type of ``key`` or raise naming both."""
    typ, f = FIELDS[key]
    bad = ConfigError(f"`{key}` expects {type_name(typ)}, got {value!r}.")
    result: Any
    if typ is bool:
        if isinstance(value, bool):
            result = value
        elif from_cli and str(value).lower() in BOOL_WORDS:
            result = str(value).lower() == "true"
        else:
            raise _not_boolean(key, value, from_cli)
    elif typ is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            result = value
        elif from_cli:
            try:
                result = int(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
    elif typ is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            result = float(value)
        elif from_cli:
            try:
                result = float(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
    elif typ is StrList:
        if isinstance(value, str):  # comma-separated on the command line; one item in a file
            value = [item.strip() for item in value.split(",") if item.strip()] if from_cli else [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
            raise bad
        result = StrList(value)
    elif typ is FloatList:
        if from_cli and isinstance(value, str):
            try:
                value = [float(item) for item in value.split(",") if item.strip()]
            except ValueError:
                raise bad from None
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(item, (int, float)) and not isinstance(item, bool) for item in value
        ):
            raise bad
        result = FloatList(float(item) for item in value)
    else:
        if not isinstance(value, str):
            raise bad
        result = value
    choices = f.metadata["choices"]
    items = result if isinstance(result, tuple) else (result,)
    if choices is None:
        return result
    # A choice is a name: its spelling in any case means it (`zbvzerobubble` is `ZBVZeroBubble`).
    canonical = {choice.lower(): choice for choice in choices}
    for item in items:
        if item.lower() not in canonical:
            raise ConfigError(f"`{key}` must be one of {', '.join(choices)}; got {item!r}.")
    if isinstance(result, tuple):
        return type(result)(canonical[item.lower()] for item in result)
    return canonical[result.lower()]


def _not_boolean(key: str, value: Any, from_cli: bool) -> ConfigError:
    accepted = "true or false (either case), or the bare flag for true" if from_cli else "true or false (unquoted)"
    return ConfigError(f"`{key}` is boolean: give {accepted}; got {value!r}.")


def _set(config: JobConfig, key: str, value: Any) -> None:
    section, name = key.split(".")
    setattr(getattr(config, section), name, value)


def resolve_config_path(name: str) -> Path:
    """``--config`` takes a path, or a file name inside ``train_configs/``."""
    for candidate in (Path(name), CONFIG_DIR / name):
        if candidate.is_file():
            return candidate
    available = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"config file `{name}` not found (nor in {CONFIG_DIR}); available: {available}.")


def load_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: `{section}` must be a key inside a [section] table.")
    return data


def parse_mesh(spec: str) -> dict[str, int]:
    """``pp=2,dp_replicate=2,dp_shard=2,tp=2`` -> the six parallelism degrees (ep included).

    The shorthand describes the whole mesh: a dimension it does not name is 1, except dp_shard,
    which is then inferred from the world size.
    """
    degrees = {"pp": 1, "dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1, "ep": 1}
    for part in filter(None, spec.split(",")):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_DIMS:
            close = ["dp_shard", "dp_replicate"] if name == "dp" else difflib.get_close_matches(name, MESH_DIMS, 2)
            hint = f" Did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else ""
            raise ConfigError(
                f"--mesh: cannot read `{part}`; write e.g. `--mesh dp_replicate=2,dp_shard=2,tp=2` "
                f"with dimensions from {', '.join(MESH_DIMS)}.{hint}"
            )
        try:
            degrees[name] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh: `{name}` expects an integer, got {value!r}.") from None
    return {f"parallelism.{MESH_DIMS[k]}": v for k, v in degrees.items()}


def _split_cli(argv: list[str]) -> tuple[str | None, str | None, list[tuple[str, Any]]]:
    """Split argv into (--config, --mesh, [(key, raw value)]) without interpreting values."""
    config_name = mesh = None
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument `{arg}`; options look like `--section.key value`.")
        key, eq, value = arg[2:].partition("=")
        if key in ("config", "mesh"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{key} needs a value.")
                i += 1
                value = argv[i]
            if key == "config":
                config_name = value
            else:
                mesh = value
        elif key.replace("-", "_") in FIELDS:
            key = key.replace("-", "_")
            typ = FIELDS[key][0]
            if eq:
                overrides.append((key, value))
            elif typ is bool:
                if i + 1 < len(argv) and argv[i + 1].lower() in BOOL_WORDS:
                    i += 1
                    overrides.append((key, argv[i]))
                elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    raise _not_boolean(key, argv[i + 1], from_cli=True)
                else:
                    overrides.append((key, True))
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(f"`--{key}` needs a value.")
                i += 1
                overrides.append((key, argv[i]))
        else:
            raise _unknown_key(key)
        i += 1
    return config_name, mesh, overrides


def help_text(argv: list[str] | None = None) -> str:
    """Every key, with the value the run would take from ``argv`` (the config file it names,
    ``debug_model.toml`` by default, and any overrides) and the code's default beside it.

    A user about to run ``./run_train.sh`` wants to see what *that* run does, not the dataclass
    defaults; when ``argv`` has an error, the error is shown and the file's values are left out.
    """
    argv = [arg for arg in (argv or []) if arg not in ("--help", "-h")]
    source = "the code"
    try:
        values = load_config(argv)
        config_name, _, _ = _split_cli(argv)
        source = (resolve_config_path(config_name) if config_name else DEFAULT_CONFIG).name
    except ConfigError as e:
        values, source = JobConfig(), f"the code (the command line has an error: {e})"
    lines = [
        "usage: ./run_train.sh [--config FILE] [--mesh pp=P,dp_replicate=R,dp_shard=S,tp=T,cp=C,ep=E] [--dry-run] [--section.key VALUE ...]",
        "",
        "  --config FILE   TOML file, a path or a name inside train_configs/ (default: debug_model.toml)",
        "  --mesh SPEC     the whole mesh at once; unnamed dimensions are 1, dp_shard is inferred",
        "  --dry-run       check everything, print the plan and the per-rank memory estimate, and exit",
        "",
        "Every key can be set in the TOML file ([section] key = value) or as --section.key VALUE,",
        "--section.key=VALUE; a bare boolean flag means true.",
        f"Values shown: what this command line gives, from {source}; the code's default beside where it differs.",
    ]
    section = None
    for key, (typ, f) in FIELDS.items():
        sec, name = key.split(".")
        if sec != section:
            section = sec
            lines += ["", f"[{sec}]"]
        choices = f" {{{'|'.join(f.metadata['choices'])}}}" if f.metadata["choices"] else ""
        value, default = getattr(getattr(values, sec), name), f.default
        shown = _shown(typ, value) + ("" if value == default else f"; code default {_shown(typ, default)}")
        lines.append(f"  --{key} ({type_name(typ)}{choices}) = {shown}")
        limits = f.metadata["limits"]
        must = "Each must be" if typ is FloatList else "Must be"
        lines.append(f"      {f.metadata['doc']}" + (f" {must} {limits.describe()}." if limits else ""))
    return "\n".join(lines)


def _shown(typ: type, value: Any) -> str:
    if typ is StrList:
        return ",".join(value)
    return ",".join(map(repr, value)) if typ is FloatList else repr(value)


def load_config(argv: list[str]) -> JobConfig:
    """Defaults < TOML file < ``--mesh`` < ``--section.key`` overrides; then the values' own
    rules (``validate.py``) and the settings that would change nothing (``dependent_settings.py``)."""
    config_name, mesh, overrides = _split_cli(argv)
    path = resolve_config_path(config_name) if config_name else DEFAULT_CONFIG
    config = JobConfig()
    for section, values in load_toml(path).items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if key not in FIELDS:
                raise _unknown_key(key)
            _set(config, key, _coerce(key, value, from_cli=False))
    from_file = copy.deepcopy(config)
    command_line = {key for key, _ in overrides}
    if mesh is not None:
        mesh_values = parse_mesh(mesh)
        command_line |= set(mesh_values)
        for key, value in overrides:
            if key in mesh_values and _coerce(key, value, from_cli=True) != mesh_values[key]:
                raise ConfigError(f"`--{key} {value}` contradicts `--mesh {mesh}`; give one of them.")
        for key, value in mesh_values.items():
            _set(config, key, value)
    for key, value in overrides:
        _set(config, key, _coerce(key, value, from_cli=True))
    validate(config)
    check_dependent_settings(config, from_file, command_line)
    return config


def changed_settings(config: JobConfig) -> list[str]:
    """``key=value`` for every setting that differs from the code's default: a run's config in
    a few lines (the whole of it is in the saved ``config.toml``)."""
    changed = []
    for key, (typ, f) in FIELDS.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value != f.default:
            changed.append(f"{key}={_shown(typ, value)}")
    return changed


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML, loadable again with ``--config``."""
    return tomli_w.dumps(dataclasses.asdict(config))
