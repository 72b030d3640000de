"""One configuration mechanism for every command: a dataclass tree -> YAML sections + flags.

A command's settings are one dataclass (a *tree*: a field whose type is itself a dataclass is a
*section*, as ``model:``/``data:``/... of ``hvd-lm train``). From that one declaration come

* the YAML layout (:func:`from_dict`, :func:`load_yaml`, :func:`save_yaml`): sections are
  mappings, leaves are values; unknown keys, wrong types and out-of-range values are errors that
  name the file and the dotted field (``demo.yaml: train.optim.lr_rule``);
* the command-line flags (:func:`add_arguments`): one ``--field-name`` per leaf (leaf names are
  unique in a tree), its help text ending in ``[section.field, default X]``; flags override the
  YAML file given with ``--config``; and
* the validation (choices, bounds, required fields, and the dataclass's own ``check()`` for rules
  across fields), run whichever way the values came in.

Leaves are declared with :func:`option`, whose metadata says how the flag looks where argparse's
default would not do: a positional argument, an on/off switch (``--resume``, ``--no-dedup``),
a value parser (``64M`` -> bytes), extra flag spellings. This module knows nothing of any
command; each command's module owns its dataclass tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
import traceback
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from hvd_lm.core.atomic import write_text

MISSING = dataclasses.MISSING


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
    meta = {"help": help, "choices": choices, "flag": flag, "aliases": tuple(aliases),
            "positional": positional, "switch": switch, "parse": parse, "metavar": metavar,
            "ge": ge, "gt": gt, "le": le, "required": required, "finite": finite, "cli": cli,
            "nargs": nargs}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ---- the tree -----------------------------------------------------------------------------------

def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def _optional_inner(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> (X, True); X -> (X, False)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return (inner[0] if len(inner) == 1 else tp), True
    return tp, False


def leaves(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                   dataclasses.Field, Any]]:
    """(dotted path, field, type) of every leaf of the tree ``cls``, in declaration order."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            yield from leaves(tp, path + (f.name,))
        else:
            yield path + (f.name,), f, tp


def _kind(tp: Any) -> tuple[type, type | None, bool]:
    """(base type, element type for lists/tuples or None, optional?) of a leaf type."""
    tp, optional = _optional_inner(tp)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return origin, (args[0] if args else str), optional
    return tp, None, optional


def _scalar(value: Any, tp: type, where: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        raise ConfigError(f"{where}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected int, got {value!r}")
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{where}: expected int, got {value!r}")
            return int(value)
        try:
            return int(str(value).strip())
        except ValueError:
            raise ConfigError(f"{where}: expected int, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected float, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected float, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected str, got {value!r}")
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
            out = [parse(v) if (parse and isinstance(v, str)) else _scalar(v, elem, where)
                   for v in items]
            return tuple(out) if base is tuple else out
        return _scalar(value, base, where)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_leaf(value: Any, f: dataclasses.Field, where: str) -> None:
    m = f.metadata
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if v is None:
            continue
        if m.get("choices") and v not in m["choices"]:
            raise ConfigError(f"{where} must be one of {list(m['choices'])}, got {v!r}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if isinstance(v, float) and m.get("finite", True) and not math.isfinite(v):
                raise ConfigError(f"{where} must be a finite number, got {v!r}")
            if m.get("ge") is not None and not v >= m["ge"]:
                raise ConfigError(f"{where} must be >= {m['ge']:g}, got {v!r}")
            if m.get("gt") is not None and not v > m["gt"]:
                raise ConfigError(f"{where} must be > {m['gt']:g}, got {v!r}")
            if m.get("le") is not None and not v <= m["le"]:
                raise ConfigError(f"{where} must be <= {m['le']:g}, got {v!r}")


def validate(obj: Any, source: str = "config", path: tuple[str, ...] = ()) -> None:
    """Check every leaf's choices and bounds, then each section's own ``check()`` (rules across
    fields, raising ValueError), depth first.

    Raises:
        ConfigError: naming ``source`` and the dotted field.
    """
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_section(hints[f.name]):
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


def check_required(obj: Any, source: str = "command line") -> None:
    """Every leaf declared ``required`` is set (not None, not empty).

    Raises:
        ConfigError: naming the first missing one and its flag.
    """
    for path, f, _ in leaves(type(obj)):
        if not f.metadata.get("required"):
            continue
        value = obj
        for name in path:
            value = getattr(value, name)
        if value is None or value == "" or value == [] or value == ():
            raise ConfigError(f"{source}: {'.'.join(path)} is required ({_flag_text(f)})")


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
        raise ConfigError(f"{source}: {where} must be a mapping, got {data!r}")
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            if not path and any(_is_section(hints[k]) for k in known):
                raise ConfigError(f"{source}: unknown section {key!r} (known: "
                                  f"{', '.join(known)})")
            raise ConfigError(f"{source}: unknown field {'.'.join(path + (str(key),))} "
                              f"(known: {', '.join(known)})")
        tp = hints[key]
        if _is_section(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, source, path + (key,))
        else:
            kwargs[key] = coerce(value, known[key], tp,
                                 f"{source}: {'.'.join(path + (key,))}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {where}: {e}") from None


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


def load_yaml(cls: type, path: str | Path) -> Any:
    """The tree ``cls`` from a YAML file.

    Raises:
        ConfigError: the file is missing or unreadable, not YAML, or does not fit ``cls``
            (naming the file and field).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return from_dict(cls, data, str(path))


def save_yaml(obj: Any, path: str | Path) -> None:
    """Write the tree as YAML, atomically (temp file + rename)."""
    write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))


# ---- command-line flags --------------------------------------------------------------------------

def _flag_text(f: dataclasses.Field) -> str:
    if f.metadata.get("positional"):
        return f"argument {f.name.upper()}"
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _dest(path: tuple[str, ...]) -> str:
    return "cfg__" + "__".join(path)


def add_arguments(parser: argparse.ArgumentParser, cls: type, config_flag: bool = True,
                  groups: bool = True) -> None:
    """Add ``--config FILE`` (optional) and one argument per leaf of ``cls`` to ``parser``.

    Every flag defaults to "unset" (None), so a YAML value survives unless the flag is given; the
    help text ends with ``[section.field, default X]``. Sections become argparse groups.

    Raises:
        ValueError: two leaves with the same flag (a programming error in ``cls``).
    """
    if config_flag:
        parser.add_argument("--config", metavar="FILE",
                            help="YAML file with these settings; flags override its values")
    seen: dict[str, str] = {}
    group_of: dict[tuple[str, ...], Any] = {}
    for path, f, tp in leaves(cls):
        m = f.metadata
        if not m.get("cli", True):
            continue
        target = parser
        if groups and len(path) > 1:
            if path[:-1] not in group_of:
                sec = ".".join(path[:-1])
                group_of[path[:-1]] = parser.add_argument_group(sec)
            target = group_of[path[:-1]]
        default = (f.default if f.default is not MISSING else
                   (f.default_factory() if f.default_factory is not MISSING else None))
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        tail = f", default {shown}" if shown not in ("", None) or not m.get("positional") else ""
        help_text = f"{m.get('help', '')} [{'.'.join(path)}{tail}]".strip()
        base, elem, _ = _kind(tp)
        metavar = m.get("metavar")
        if m.get("positional"):
            nargs = "*" if elem is not None else "?"
            target.add_argument(_dest(path), nargs=nargs, default=None, metavar=metavar
                                or f.name.upper(), help=help_text)
            continue
        names = [_flag_text(f), *m.get("aliases", ())]
        for n in names:
            if n in seen:
                raise ValueError(f"flag {n} is declared twice ({seen[n]} and {'.'.join(path)})")
            seen[n] = ".".join(path)
        if m.get("switch") is not None:
            target.add_argument(*names, dest=_dest(path), action="store_const",
                                const=m["switch"], default=None, help=help_text)
            continue
        choices = m.get("choices") if (m.get("parse") is None and elem is None
                                      and base in (str,)) else None
        target.add_argument(*names, dest=_dest(path), default=None, choices=choices,
                            nargs=m.get("nargs"),
                            metavar=metavar or (None if choices else
                                                (elem or base).__name__.upper()),
                            help=help_text)


def from_args(cls: type, args: argparse.Namespace, source: str | None = None,
              required: bool = True) -> Any:
    """The tree from ``--config`` (when given) with every argument the user set applied on top,
    validated; with ``required`` also :func:`check_required`.

    Raises:
        ConfigError: as :func:`from_dict` / :func:`load_yaml`, naming the file or
            ``command line``.
    """
    config = getattr(args, "config", None)
    data = to_dict(load_yaml(cls, config)) if config else {}
    for key, value in vars(args).items():
        if not key.startswith("cfg__") or value is None:
            continue
        if isinstance(value, list) and not value:  # an empty positional list: not given
            continue
        node = data
        *sections, name = key[5:].split("__")
        for sec in sections:
            node = node.setdefault(sec, {})
        node[name] = value
    src = source or (f"{config} + command line" if config else "command line")
    obj = from_dict(cls, data, src)
    if required:
        check_required(obj, src)
    return obj


def to_argv(obj: Any) -> list[str]:
    """The command-line words that :func:`from_args` turns back into ``obj`` (every leaf that
    has a flag: ``--flag value``, lists comma-joined, switches only when set, positionals last),
    e.g. to start worker processes with a driver's settings.

    Raises:
        ValueError: a value that cannot round-trip through a flag (a list of lists, a comma inside
            a list item).
    """
    words: list[str] = []
    positional: list[str] = []
    for path, f, _ in leaves(type(obj)):
        m = f.metadata
        if not m.get("cli", True):
            continue
        value = obj
        for name in path:
            value = getattr(value, name)
        if m.get("positional"):
            positional += [str(v) for v in value] if isinstance(value, (list, tuple)) else (
                [] if value in (None, "") else [str(value)])
            continue
        if m.get("switch") is not None:
            if value == m["switch"]:
                words.append(_flag_text(f))
            continue
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            if any("," in str(v) for v in value):
                raise ValueError(f"{'.'.join(path)}: list items with commas cannot be flags")
            words += [_flag_text(f), ",".join(str(v) for v in value)]
        else:
            words += [_flag_text(f), str(value)]
    return words + (["--", *positional] if positional else [])


# ---- argparse, one error line ---------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line, as every other error of the
    command line: ``PROG: ERROR: argument --precision (run.precision): invalid choice: 'fp8'
    (choose from 'fp32', 'fp16', 'bf16'); PROG --help lists the flags``, exit status 2 (argparse's),
    instead of the usage block and a lower-case ``error:`` line.

    The message names the dotted field behind a generated flag (:func:`add_arguments`), and an
    unrecognized argument is reported by the (sub)command that was given it, with the closest
    flag it has when one is close (``difflib``). Subparsers (``add_subparsers``) are of this
    class too (argparse gives them the parent's class).
    """

    def error(self, message: str):
        """Print ``PROG: ERROR: MESSAGE`` (with the field) and exit 2."""
        what = ("commands" if any(isinstance(a, argparse._SubParsersAction)
                                  for a in self._actions) else "flags")
        self.exit(2, f"{self.prog}: ERROR: {self._with_field(message)}; {self.prog} --help "
                  f"lists the {what}\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, with unrecognized arguments reported by the subcommand that got them
        (naming the closest known flag)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(ns)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser._closest(extras)}")
        return ns

    def _chosen(self, ns: argparse.Namespace) -> "ArgumentParser":
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(ns, action.dest, None) or "")
                if isinstance(sub, ArgumentParser):
                    return sub._chosen(ns)
        return self

    def _closest(self, extras: list[str]) -> str:
        known = {o[2:]: o for a in self._actions for o in a.option_strings if o[:2] == "--"}
        for word in extras:
            if word.startswith("--"):  # compared without the dashes every flag shares
                close = difflib.get_close_matches(word.split("=")[0][2:], list(known), n=1)
                if close:
                    return f" (did you mean {known[close[0]]}?)"
        return ""

    def _with_field(self, message: str) -> str:
        """``argument --x: ...`` -> ``argument --x (section.field): ...`` for generated flags."""
        head, sep, rest = message.partition(": ")
        if not (sep and head.startswith("argument ")):
            return message
        names = head[len("argument "):]
        for action in self._actions:
            if names in ("/".join(action.option_strings), action.metavar, action.dest) \
                    and action.dest.startswith("cfg__"):
                return f"{head} ({action.dest[5:].replace('__', '.')}): {rest}"
        return message


# ---- commands -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    """A command line program declared by its settings and what it does: ``hvd-lm``'s table
    (:mod:`hvd_lm.cli`), ``python -m data_prep`` and the benchmark workers all run commands
    through this one path (parse -> validate -> run -> exit status).

    Attributes:
        config: the settings' dataclass tree.
        run: ``run(settings) -> exit status`` (None means 0).
        description / epilog: for ``--help``.
        flags: generate one flag per leaf (False: only ``--config FILE``, e.g. the demo, whose
            tree repeats leaf names).
        config_flag: offer ``--config FILE`` (False where a leaf owns that name).
        default_config: the YAML read when ``--config`` is not given (``flags=False`` commands).
        usage_errors: exceptions that mean bad input (exit 2 like a bad flag); any other error
            exits 1. Either way one ``ERROR:`` line, the traceback only with ``--debug``.
    """

    config: type
    run: Callable[[Any], int | None]
    description: str = ""
    epilog: str = ""
    flags: bool = True
    config_flag: bool = True
    default_config: str | None = None
    usage_errors: tuple = ()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's arguments (and its description/epilog) to ``parser``."""
        if self.description:
            parser.description = self.description
        if self.epilog:
            parser.epilog = self.epilog
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
        if self.flags:
            add_arguments(parser, self.config, config_flag=self.config_flag)
        else:
            parser.add_argument("--config", metavar="FILE", default=self.default_config,
                                help=f"YAML file with the settings (default {self.default_config})")

    def settings(self, args: argparse.Namespace) -> Any:
        """The validated settings from parsed ``args`` (:func:`from_args`)."""
        if not self.flags:
            return load_yaml(self.config, args.config)
        return from_args(self.config, args)

    def invoke(self, args: argparse.Namespace, name: str) -> int:
        """Parse settings from ``args`` and run; errors become one ``<name>: ERROR: ...`` line
        on stderr (``args.debug``: with the traceback). Returns the exit status: 0 done, 1 a
        runtime error, 2 bad settings or input, 130 interrupted."""
        try:
            return int(self.run(self.settings(args)) or 0)
        except KeyboardInterrupt:
            print(f"{name}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - every error becomes one line (or a traceback)
            if getattr(args, "debug", False):
                traceback.print_exc()
            print(f"{name}: ERROR: {error_text(e)}", file=sys.stderr)
            return 2 if isinstance(e, (ConfigError, *self.usage_errors)) else 1

    def main(self, argv: list[str] | None, prog: str) -> int:
        """A stand-alone entry point (``python -m ...``): parse ``argv`` and :meth:`invoke`."""
        parser = ArgumentParser(prog=prog)
        parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
        self.add_arguments(parser)
        return self.invoke(parser.parse_args(argv), prog)


def error_text(e: BaseException) -> str:
    """One line for an exception: its message (KeyError's without quotes), or its type."""
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    text = str(e).strip() or type(e).__name__
    if not isinstance(e, (ValueError, OSError, RuntimeError, LookupError)):
        text = f"{type(e).__name__}: {text}"
    return text
