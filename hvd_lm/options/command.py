"""The command line of a settings tree: one flag per leaf, argparse errors in one line, and
:class:`Command` (parse -> validate -> run -> exit status), the one path every entry point of
``hvd-lm``, ``python -m data_prep`` and the benchmark workers goes through. The tree itself
(leaves, validation, YAML) is :mod:`hvd_lm.options.tree`.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import sys
import traceback
from dataclasses import MISSING, dataclass
from typing import Any, Callable

from hvd_lm.options.tree import (
    ConfigError,
    _kind,
    check_required,
    flag_text,
    from_dict,
    leaves,
    load_yaml,
    to_dict,
)
from hvd_lm.util.files import LINE_CHARS, shown

# ---- command-line flags --------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser, cls: type, config_flag: bool = True) -> None:
    """Add ``--config FILE`` (optional) and one argument per leaf of ``cls`` to ``parser``.

    Every flag defaults to "unset" (None), so a YAML value survives unless the flag is given; the
    help text ends with ``[section.field, default X]``. Sections become argparse groups.

    Raises:
        argparse.ArgumentError: two leaves with the same flag ("conflicting option string": a
            programming error in ``cls``).
    """
    if config_flag:
        parser.add_argument("--config", metavar="FILE",
                            help="YAML file with these settings; flags override its values")
    groups: dict[str, Any] = {"": parser}
    for path, f, tp in leaves(cls, flags=True):
        m, dest = f.metadata, "cfg__" + "__".join(path)
        section = ".".join(path[:-1])
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        target = groups[section]
        default = (f.default if f.default is not MISSING else
                   (f.default_factory() if f.default_factory is not MISSING else None))
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        tail = f", default {shown}" if shown not in ("", None) or not m.get("positional") else ""
        help_text = f"{m.get('help', '')} [{'.'.join(path)}{tail}]".strip()
        base, elem, _ = _kind(tp)
        metavar = m.get("metavar")
        if m.get("positional"):
            target.add_argument(dest, nargs="*" if elem is not None else "?", default=None,
                                metavar=metavar or f.name.upper(), help=help_text)
            continue
        names = [flag_text(f), *m.get("aliases", ())]  # (one declared twice: argparse refuses)
        if m.get("switch") is not None:
            target.add_argument(*names, dest=dest, action="store_const",
                                const=m["switch"], default=None, help=help_text)
            continue
        choices = m.get("choices") if (m.get("parse") is None and elem is None
                                      and base is str) else None
        metavar = metavar or (None if choices else (elem or base).__name__.upper())
        target.add_argument(*names, dest=dest, default=None, choices=choices,
                            nargs=m.get("nargs"), metavar=metavar, help=help_text)


def from_args(cls: type, args: argparse.Namespace, required: bool = True) -> Any:
    """The tree from ``--config`` (when given) with every argument the user set applied on top,
    validated; with ``required`` also :func:`check_required`.

    Raises:
        ConfigError: as :func:`from_dict` / :func:`load_yaml`, naming the file or
            ``command line``.
    """
    config = getattr(args, "config", None)
    data = to_dict(load_yaml(cls, config)) if config else {}
    for key, value in vars(args).items():
        if not key.startswith("cfg__") or value is None or value == []:  # ([]: no positionals)
            continue
        *sections, name = key[5:].split("__")  # the leaf's mapping, its sections made
        functools.reduce(lambda node, sec: node.setdefault(sec, {}), sections, data)[name] = value
    src = f"{config} + command line" if config else "command line"
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
    for path, f, _ in leaves(type(obj), flags=True):
        m = f.metadata
        value = functools.reduce(getattr, path, obj)  # the leaf's value, through its sections
        if m.get("positional"):
            positional += [str(v) for v in value] if isinstance(value, (list, tuple)) else (
                [] if value in (None, "") else [str(value)])
            continue
        if m.get("switch") is not None:
            words += [flag_text(f)] if value == m["switch"] else []
        elif isinstance(value, (list, tuple)):
            if any("," in str(v) for v in value):
                raise ValueError(f"{'.'.join(path)}: list items with commas cannot be flags")
            words += [flag_text(f), ",".join(map(str, value))]
        elif value is not None:
            words += [flag_text(f), str(value)]
    return words + (["--", *positional] if positional else [])


# ---- argparse, one error line --------------------------------------------------------------------

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
        what = "commands" if self._subparsers is not None else "flags"
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


# ---- commands ------------------------------------------------------------------------------------

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
        return from_args(self.config, args) if self.flags else load_yaml(self.config, args.config)

    def invoke(self, args: argparse.Namespace, name: str) -> int:
        """Parse settings from ``args`` and run; errors become one ``<name>: ERROR: ...`` line
        on stderr (``args.debug``: with the traceback). Returns the exit status: 0 done, 1 a
        runtime error, 2 bad settings or input, 130 interrupted."""
        try:
            rc = int(self.run(self.settings(args)) or 0)
        except KeyboardInterrupt:
            print(f"{name}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - every error becomes one line (or a traceback)
            if getattr(args, "debug", False):
                traceback.print_exc()
            if not getattr(e, "quiet", False):  # (a rank's copy of rank 0's error: no line)
                print(f"{name}: ERROR: {error_text(e)}", file=sys.stderr)
            return 2 if isinstance(e, (ConfigError, *self.usage_errors)) else 1
        # a command that ended cleanly on the torch engine waits for its peers at exit
        # (hvd_lm.comm.torch_engine.shutdown); looked up, not imported: options is below comm
        if rc == 0 and (engine := sys.modules.get("hvd_lm.comm.torch_engine")) is not None:
            engine.ENDED_CLEANLY = True
        return rc

    def main(self, argv: list[str] | None, prog: str) -> int:
        """A stand-alone entry point (``python -m ...``): parse ``argv`` and :meth:`invoke`."""
        parser = ArgumentParser(prog=prog)
        parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
        self.add_arguments(parser)
        return self.invoke(parser.parse_args(argv), prog)


def error_text(e: BaseException) -> str:
    """One line for an exception: its message (KeyError's without quotes), or its type; an
    OSError of the system (``[Errno 36] File name too long: '...'``) as ``PATH: reason``; every
    control character escaped and the line cut to :data:`hvd_lm.util.files.LINE_CHARS`
    (:func:`hvd_lm.util.files.shown`), so a path holding a newline never prints a second line."""
    if isinstance(e, KeyError) and e.args:
        text = str(e.args[0])
    elif isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{shown(e.filename)}: {e.strerror[:1].lower()}{e.strerror[1:]}"
        if e.filename2 is not None:
            text += f" (-> {shown(e.filename2)})"
    else:
        text = str(e).strip() or type(e).__name__
        if not isinstance(e, (ValueError, OSError, RuntimeError, LookupError)):
            text = f"{type(e).__name__}: {text}"
    return shown(text, LINE_CHARS)
