"""One configuration mechanism for every command: a dataclass tree -> YAML sections + flags.

A command's settings are one dataclass (a *tree*: a field whose type is itself a dataclass is a
*section*, as ``model:``/``data:``/... of ``hvd-lm train``). From that one declaration come

* the YAML layout (:func:`from_dict`, :func:`load_yaml`, :func:`save_yaml`): sections are
  mappings, leaves are values; unknown keys, wrong types and out-of-range values are errors that
  name the file and the dotted field (``demo.yaml: train.optim.lr_rule``);
* the command-line flags (:mod:`hvd_lm.options.command`): one ``--field-name`` per leaf (leaf
  names are unique in a tree), its help text ending in ``[section.field, default X]``; flags
  override the YAML file given with ``--config``; and
* the validation (choices, bounds, required fields, and the dataclass's own ``check()`` for rules
  across fields), run whichever way the values came in.

Leaves are declared with :func:`option`, whose metadata says how the flag looks where argparse's
default would not do: a positional argument, an on/off switch (``--resume``, ``--no-dedup``),
a value parser (``64M`` -> bytes), extra flag spellings. This module holds the tree (leaves,
validation, YAML); it knows nothing of any command; each command's module owns its dataclass
tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from hvd_lm.util.atomic import write_text
from hvd_lm.util.files import SHOWN_CHARS, FileRefused, read_bounded
from hvd_lm.util.files import shown as shown_path

MISSING = dataclasses.MISSING

#: Bytes of a YAML file read at most: a config or a source list is a few kB.
MAX_YAML_BYTES = 1 << 20
#: Nodes of a YAML document counted with every alias expanded: a "billion laughs" file of a few
#: hundred bytes (nine lists of nine aliases of the previous one) expands to 9**9 nodes; a real
#: config has a few hundred.
MAX_YAML_NODES = 100_000

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, SHOWN_CHARS, 80, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type or out of range; the message names the source
    (file, ``command line``) and the dotted field."""


def option(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING,
           choices: tuple | None = None, flag: str | None = None, aliases: tuple = (),
           positional: bool = False, switch: bool | None = None, parse: Callable | None = None,
           metavar: str | None = None, ge: float | None = None, gt: float | None = None,
           le: float | None = None, required: bool = False, finite: bool = True,
           cli: bool = True, nargs: str | None = None) -> Any:
    """A configuration leaf: a ``dataclasses.field`` with the metadata :func:`add_arguments` and
    :func:`from_dict` read.

    Args:
        default / default_factory: as ``dataclasses.field``.
        help: one line for ``--help`` (units in it: bytes, chars, seconds, MiB...).
        choices: allowed values.
        flag: the flag's spelling (default ``--field-name``); aliases: more spellings.
        positional: a positional argument (``nargs`` from the type: a list takes ``*``).
        switch: a flag without a value that sets the field to ``switch`` (``True`` for
            ``--resume``; ``False`` for ``--no-dedup`` on ``dedup``, with ``flag`` naming it).
        parse: ``str -> value`` for text from the command line or YAML (e.g. ``"64M"`` -> bytes);
            a ``ValueError`` it raises becomes a :class:`ConfigError` naming the field.
        metavar: shown in ``--help``.
        ge / gt / le: bounds (``value >= ge``, ``> gt``, ``<= le``); NaN fails every bound.
        required: must be set (non-empty) when the command runs (checked by
            :func:`check_required`, not by :func:`from_dict`: a section embedded in another
            command's file, like the demo's, may leave it to the caller).
        finite: floats must be finite (no inf/NaN).
        cli: False for a field set by the program, not by a flag (it still goes to YAML).
        nargs: for a list flag, ``"+"`` takes several words (``--workers 1 2``); by default a
            list flag takes one comma-separated word (``--sizes 4K,64K``).
    """
    meta = {k: v for k, v in locals().items() if k not in ("default", "default_factory")}
    meta["aliases"] = tuple(aliases)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


# ---- the tree -----------------------------------------------------------------------------------

def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def leaves(cls: type, path: tuple[str, ...] = (), flags: bool = False
           ) -> Iterator[tuple[tuple[str, ...], dataclasses.Field, Any]]:
    """(dotted path, field, type) of every leaf of the tree ``cls``, in declaration order; with
    ``flags`` only the leaves that have a flag (not ``cli=False``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            yield from leaves(tp, path + (f.name,), flags)
        elif not flags or f.metadata.get("cli", True):
            yield path + (f.name,), f, tp


def _kind(tp: Any) -> tuple[type, type | None, bool]:
    """(base type, element type for lists/tuples or None, optional?) of a leaf type
    (``Optional[X]``: X's, optional)."""
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    inner = [a for a in args if a is not type(None)]
    if optional and len(inner) == 1:
        tp = inner[0]
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return origin, (args[0] if args else str), optional
    return tp, None, optional


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters, built without
    expanding the whole value (:mod:`reprlib`: long strings, lists and nesting are cut with
    ``...``), so a value made of aliases of aliases never becomes a huge message."""
    text = _REPR.repr(value)
    return text if len(text) <= limit + 20 else text[:limit] + "..."


def shorten(text: str, limit: int = 2 * SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with ``...``): a message quoting its input."""
    return text if len(text) <= limit else text[:limit] + "..."


def _scalar(value: Any, tp: type, where: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        low = value.strip().lower() if isinstance(value, str) else None
        if low in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return low in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected bool (true/false), got {shown(value)}")
    if tp in (int, float):  # no bool; an int from a whole float or text, a float from any number
        if not isinstance(value, bool) and (tp is float or isinstance(value, (int, str)) or (
                isinstance(value, float) and value.is_integer())):
            with contextlib.suppress(TypeError, ValueError):
                return tp(value)
        raise ConfigError(f"{where}: expected {tp.__name__}, got {shown(value)}")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected str, got {shown(value)}")
        return str(value)
    return value


def coerce(value: Any, f: dataclasses.Field, tp: Any, where: str) -> Any:
    """``value`` (from YAML, a flag or code) as the leaf ``f`` of type ``tp``.

    Raises:
        ConfigError: naming ``where``.
    """
    base, elem, optional = _kind(tp)
    parse = f.metadata.get("parse")
    if value is None or (optional and isinstance(value, str)
                         and value.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{where}: must not be empty (null)")
    try:
        if parse is not None and isinstance(value, str):
            return parse(value)
        if elem is not None:
            items = value if isinstance(value, (list, tuple)) else [value]
            if parse is None:  # "1,2" and ["1", "2"] and ["1,2"] all mean [1, 2]
                items = [x for v in items for x in (v.split(",") if isinstance(v, str) else [v])
                         if not (isinstance(x, str) and not x.strip())]
            out = []
            for v in items:  # a parse of a list leaf gives a sequence: ["0.5", "1"] is (0.5, 1.0)
                got = parse(v) if parse and isinstance(v, str) else [_scalar(v, elem, where)]
                out.extend(got if isinstance(got, (list, tuple)) else [got])
            return tuple(out) if base is tuple else out
        return _scalar(value, base, where)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {shorten(str(e))}") from None


def _bound(x: float) -> str:
    """A bound as written: an int exactly (4294967295, not 4.29497e+09), a float by :g."""
    return str(x) if isinstance(x, int) else f"{x:g}"


#: :func:`option`'s bounds: (key, as written, the test).
_BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt), ("le", "<=", operator.le))


def _check_leaf(value: Any, f: dataclasses.Field, where: str) -> None:
    m = f.metadata
    # on the command line, the flag too: "command line: length must be <= 1048576, got
    # 1000000000000000 (--length)"
    flag = (f" ({flag_text(f)})" if "command line" in where and m.get("cli", True)
            and not m.get("positional") else "")
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is None:
            continue
        if m.get("choices") and v not in m["choices"]:
            raise ConfigError(f"{where} must be one of {list(m['choices'])}, got {shown(v)}{flag}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if isinstance(v, float) and m.get("finite", True) and not math.isfinite(v):
                raise ConfigError(f"{where} must be a finite number, got {shown(v)}{flag}")
            for key, sign, holds in _BOUNDS:  # NaN fails every bound
                if m.get(key) is not None and not holds(v, m[key]):
                    raise ConfigError(f"{where} must be {sign} {_bound(m[key])}, got {shown(v)}"
                                      f"{flag}")


def validate(obj: Any, source: str = "config", path: tuple[str, ...] = ()) -> None:
    """Check every leaf's choices and bounds, then each section's own ``check()`` (rules across
    fields, raising ValueError), depth first.

    Raises:
        ConfigError: naming ``source`` and the dotted field.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):  # a section
            validate(value, source, path + (f.name,))
        else:
            _check_leaf(value, f, f"{source}: {'.'.join(path + (f.name,))}")
    check = getattr(obj, "check", None)
    if callable(check):
        try:
            check()
        except ConfigError:
            raise
        except ValueError as e:
            prefix = f"{'.'.join(path)}: " if path else ""
            raise ConfigError(f"{source}: {prefix}{e}") from None


def flag_text(f: dataclasses.Field) -> str:
    """How the command line spells a leaf: ``--field-name`` (or its metadata's ``flag``), or
    ``argument NAME`` for a positional one."""
    return (f"argument {f.name.upper()}" if f.metadata.get("positional") else
            f.metadata.get("flag") or "--" + f.name.replace("_", "-"))


#: What a ``required`` leaf may not hold (:func:`check_required`).
EMPTY = (None, "", [], ())


def check_required(obj: Any, source: str = "command line") -> None:
    """Every leaf declared ``required`` is set (not None, not empty).

    Raises:
        ConfigError: naming the first missing one and its flag.
    """
    for path, f, _ in leaves(type(obj)):  # (the leaf's value: through its sections)
        if f.metadata.get("required") and functools.reduce(getattr, path, obj) in EMPTY:
            raise ConfigError(f"{source}: {'.'.join(path)} is required ({flag_text(f)})")


def from_dict(cls: type, data: dict | None, source: str = "config") -> Any:
    """Build the tree ``cls`` from a nested mapping (the YAML layout), then :func:`validate`.

    Raises:
        ConfigError: unknown section or field, wrong type, a value outside its choices or bounds,
            naming ``source`` and the dotted field.
    """
    obj = _build(cls, data or {}, source, ())
    validate(obj, source)
    return obj


def _build(cls: type, data: Any, source: str, path: tuple[str, ...]) -> Any:
    where = ".".join(path) or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            if not path and any(_is_section(hints[k]) for k in known):
                raise ConfigError(f"{source}: unknown section {shown(key)} (known: "
                                  f"{', '.join(known)})")
            raise ConfigError(f"{source}: unknown field {'.'.join(path + (shorten(str(key)),))} "
                              f"(known: {', '.join(known)})")
        tp = hints[key]
        if _is_section(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, source, path + (key,))
        else:
            kwargs[key] = coerce(value, known[key], tp, f"{source}: {'.'.join(path + (key,))}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {where}: {shorten(str(e))}") from None


def to_dict(obj: Any) -> dict:
    """The tree as a plain nested dict (tuples as lists): YAML-, JSON- and
    ``torch.load(weights_only=True)``-safe."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(dataclasses.asdict(obj))


def _check_expansion(root: yaml.Node, source: str, limit: int) -> None:
    """Count ``root``'s nodes with every alias expanded (each distinct node counted once with
    memoisation, so the count itself costs the document's size, not its expansion).

    Raises:
        ConfigError: more than ``limit`` nodes, or an alias inside itself.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: yaml.Node) -> int:  # (nesting deeper than Python's stack: RecursionError)
        key = id(node)
        if key in open_nodes:
            raise ConfigError(f"{source}: line {node.start_mark.line + 1}: an alias refers "
                              "to the value it is part of (a recursive YAML value)")
        if key not in sizes:
            open_nodes.add(key)
            children = node.value if isinstance(node, yaml.SequenceNode) else []
            if isinstance(node, yaml.MappingNode):
                children = [x for pair in node.value for x in pair]
            sizes[key] = 1 + sum(count(c) for c in children)
            open_nodes.discard(key)
            if sizes[key] > limit:
                raise ConfigError(f"{source}: the YAML expands to more than {limit:,} values "
                                  f"(aliases of aliases, at line {node.start_mark.line + 1}); "
                                  "a config holds a few hundred")
        return sizes[key]

    count(root)


def read_yaml(path: str | Path, max_bytes: int = MAX_YAML_BYTES,
              max_nodes: int = MAX_YAML_NODES) -> Any:
    """The data of a YAML file, read within a budget before anything looks at it: at most
    ``max_bytes`` bytes (a FIFO or ``/dev/zero`` stops there too) and ``max_nodes`` values with
    every alias expanded (PyYAML's safe loader builds an aliased value once and shares it, but
    anything that walks or prints it expands it: a "billion laughs" file).

    Raises:
        ConfigError: missing or unreadable file, a FIFO, device or socket (refused before it is
            opened: :func:`hvd_lm.util.files.read_bounded`), too large, not UTF-8, not YAML,
            nested too deeply, or expanding beyond the budget; one line naming the file.
    """
    path = Path(path)
    where = shown_path(path)
    try:  # a regular file (or <(cmd)): a FIFO nobody writes would block the open, forever
        raw = read_bounded(path, max_bytes, "a config is a YAML file", "a YAML config is a few kB")
    except FileRefused as e:  # a FIFO, a device, a socket, too large
        raise ConfigError(str(e)) from None
    except FileNotFoundError:
        raise ConfigError(f"{where}: cannot read the config file (no such file)") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the config file ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start})") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)  # libyaml's C parser when built
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, str(path), max_nodes)
        return loader.construct_document(node)
    except ConfigError:
        raise
    except (yaml.YAMLError, ValueError, TypeError) as e:  # e.g. an int of 5,000 digits
        # PyYAML's messages span lines ("expected a single document ... but found another"):
        # one line, its own "<unicode string>" (this is the file) left out
        text = " ".join(str(e).replace('in "<unicode string>", ', "").split())
        raise ConfigError(f"{where}: invalid YAML: {shorten(text)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply") from None
    finally:
        loader.dispose()


def load_yaml(cls: type, path: str | Path) -> Any:
    """The tree ``cls`` from a YAML file (:func:`read_yaml`: within its size and alias budget).

    Raises:
        ConfigError: the file is missing or unreadable, too large, not YAML, or does not fit
            ``cls`` (naming the file and field).
    """
    return from_dict(cls, read_yaml(path), shown_path(Path(path)))


def save_yaml(obj: Any, path: str | Path) -> None:
    """Write the tree as YAML, atomically (temp file + rename)."""
    write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))
