"""The configuration framework: one dataclass tree per command gives its YAML sections, its
command-line flags and its validation.

* :mod:`~hvd_lm.options.tree`: leaves declared with :func:`option`, validation, YAML
  (:func:`load_yaml`, :func:`save_yaml`, :func:`from_dict`, :func:`to_dict`);
* :mod:`~hvd_lm.options.command`: the flags (:func:`add_arguments`, :func:`from_args`,
  :func:`to_argv`), one-line argparse errors (:class:`ArgumentParser`) and :class:`Command`.

Everything public is importable from here: ``from hvd_lm.options import Command, option``.
"""
from hvd_lm.options.command import (
    ArgumentParser,
    Command,
    add_arguments,
    error_text,
    from_args,
    to_argv,
)
from hvd_lm.options.tree import (
    ConfigError,
    check_required,
    from_dict,
    load_yaml,
    option,
    save_yaml,
    to_dict,
    validate,
)

__all__ = ["ArgumentParser", "Command", "ConfigError", "add_arguments", "check_required",
           "error_text", "from_args", "from_dict", "load_yaml", "option", "save_yaml", "to_argv",
           "to_dict", "validate"]
