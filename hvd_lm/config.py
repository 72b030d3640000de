"""Run configuration: one dataclass tree, filled from YAML and then from command-line overrides.

This is the single source of truth for every training knob: the YAML schema (sections ``model``,
``data``, ``optim``, ``dist``, ``run``), the ``hvd-lm train`` flags (one ``--field-name`` per field,
generated from the dataclasses below, with their help texts) and the config saved with each run and
checkpoint. Field names are unique across sections, so ``--hidden-size 1024`` and
``model: {hidden_size: 1024}`` mean the same thing.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from hvd_lm.model import ModelConfig


def _f(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class DataConfig:
    """Where the training text comes from and how it is cut into TBPTT windows."""

    shards: str = _f("", "shard directory written by `hvd-lm prepare` (holds manifest.json)")
    train_split: str = _f("train", "manifest split to train on")
    val_split: str = _f("val", "manifest split for validation BPC ('' = none)")
    seq_len: int = _f(256, "TBPTT window length, in bytes (chars)")
    batch_size: int = _f(32, "parallel streams per rank (per-rank batch, in sequences)")
    epochs: float = _f(1.0, "passes over the training split (decay to 0 at the end)")
    seed: int = _f(1234, "seed for the data order and model init")
    verify_shards: bool = _f(True, "verify shard sha256 against the manifest before training")


@dataclass
class OptimConfig:
    """Optimiser and large-batch learning-rate schedule (see hvd_lm.schedule)."""

    optimizer: str = _f("adam", "optimiser (the reference used Adam)", ("adam", "sgd"))
    lr: float = _f(5e-4, "base LR at --lr-ref-batch (reference: 5e-4 at 128)")
    lr_ref_batch: int = _f(128, "global batch at which --lr was tuned, in sequences")
    lr_rule: str = _f("none", "scale LR to the global batch", ("none", "linear", "sqrt"))
    lr_cap: typing.Optional[float] = _f(None, "upper bound on the scaled LR (reference: 3e-3)")
    warmup_steps: int = _f(0, "linear LR warmup, in optimizer steps")
    lr_decay: str = _f("linear", "decay to 0 at the last step, or hold", ("linear", "none"))
    max_steps: typing.Optional[int] = _f(None, "stop after this many optimizer steps "
                                         "(whichever of this and --epochs comes first)")
    momentum: float = _f(0.9, "SGD momentum")
    weight_decay: float = _f(0.0, "L2 weight decay")
    grad_clip: float = _f(1.0, "clip the global gradient norm (0 = off)")


@dataclass
class DistConfig:
    """Horovod settings (see hvd_lm.distributed)."""

    compression: str = _f("fp16", "allreduce compression (reference: fp16)", ("none", "fp16"))
    backward_passes_per_step: int = _f(1, "local gradient accumulation before each allreduce")
    allreduce_op: str = _f("average", "gradient reduction", ("average", "adasum"))
    fusion_threshold_mb: typing.Optional[float] = _f(
        None, "tensor fusion buffer, MiB -> HOROVOD_FUSION_THRESHOLD (Horovod default 128)")
    cycle_time_ms: typing.Optional[float] = _f(
        None, "fusion cycle time, ms -> HOROVOD_CYCLE_TIME (Horovod default 1)")


@dataclass
class RunConfig:
    """Output, precision, logging, evaluation and checkpoint cadence."""

    out_dir: str = _f("runs/default", "run directory: metrics, config, checkpoints")
    precision: str = _f("fp32", "fp32; fp16/bf16 autocast (fp16 on CUDA only, with dynamic loss "
                        "scaling)", ("fp32", "fp16", "bf16"))
    device: str = _f("auto", "cpu, cuda, or auto (cuda:local_rank when available)")
    threads: int = _f(0, "torch intra-op threads per rank (0 = cores / local ranks)")
    log_every: int = _f(10, "log a metrics line every N steps")
    eval_every: int = _f(0, "validation BPC every N steps (0 = only at the end)")
    eval_chars: int = _f(262144, "validation bytes per evaluation (0 = the whole split)")
    checkpoint_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    checkpoint_minutes: float = _f(0.0, "also checkpoint every M minutes of wall time (0 = off)")
    keep_checkpoints: int = _f(3, "keep the last K step checkpoints")
    resume: str = _f("", "checkpoint file or run directory to resume from ('auto' = out_dir)")
    nan_check: bool = _f(True, "skip (and count) steps whose loss or gradients are not finite")
    inject_nan_steps: str = _f("", "testing aid: comma-separated step attempts (applied + "
                                "skipped, 0-based) whose loss rank 0 makes NaN")
    tensorboard: bool = _f(True, "write TensorBoard events when tensorboard is installed")


@dataclass
class TrainConfig:
    """Everything one training run needs; saved as config.yaml in the run and in checkpoints."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        """Plain nested dict (YAML/JSON/torch.load(weights_only=True) safe)."""
        return asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
_MODEL_HELP = {
    "cell": "recurrent cell: mlstm (reference) or lstm",
    "embed_dim": "byte embedding width",
    "hidden_size": "recurrent state width H (reference 4096)",
    "weight_norm": "weight-normalise recurrent and gate weights (as the reference)",
    "vocab_size": "output classes (256 byte values)",
}


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {name: hints[name] for name in SECTIONS}


def _fields():
    """(section, field, type) for every config field, in declaration order."""
    for section, cls in _section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f, hints[f.name]


def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _coerce(value, tp, where: str):
    """``value`` converted to field type ``tp``; raises ValueError naming ``where``."""
    base = _base_type(tp)
    if value is None:
        if base is not tp:  # Optional
            return None
        raise ValueError(f"{where}: must not be null")
    try:
        if base is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if base is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if base is int and isinstance(value, str) and value.strip().lower() in ("none", "null"):
            if base is not tp:
                return None
        if base is float and isinstance(value, str) and value.strip().lower() in ("none", "null"):
            if base is not tp:
                return None
        return base(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected {base.__name__}, got {value!r}") from None


def from_dict(data: dict, source: str = "config") -> TrainConfig:
    """Build a :class:`TrainConfig` from a nested dict (YAML layout).

    Raises:
        ValueError: unknown section or field, wrong type, or a value outside its choices, naming
            ``source`` and the dotted field (e.g. ``demo.yaml: optim.lr_rule``).
    """
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: top level must be a mapping of sections {list(SECTIONS)}")
    classes = _section_classes()
    cfg = TrainConfig()
    for section, values in data.items():
        if section not in classes:
            raise ValueError(f"{source}: unknown section {section!r} (known: {list(SECTIONS)})")
        if not isinstance(values, dict):
            raise ValueError(f"{source}: section {section!r} must be a mapping")
        target = getattr(cfg, section)
        hints = typing.get_type_hints(classes[section])
        known = {f.name: f for f in dataclasses.fields(classes[section])}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"{source}: unknown field {section}.{key} "
                                 f"(known: {', '.join(known)})")
            setattr(target, key, _coerce(value, hints[key], f"{source}: {section}.{key}"))
    validate(cfg, source)
    return cfg


def validate(cfg: TrainConfig, source: str = "config") -> None:
    """Check choices and ranges. Raises ValueError naming the dotted field."""
    for section, f, _ in _fields():
        choices = f.metadata.get("choices")
        value = getattr(getattr(cfg, section), f.name)
        if choices and value not in choices:
            raise ValueError(f"{source}: {section}.{f.name} must be one of {choices}, got {value!r}")
    for name in ("seq_len", "batch_size"):
        if getattr(cfg.data, name) < 1:
            raise ValueError(f"{source}: data.{name} must be >= 1")
    if cfg.dist.backward_passes_per_step < 1:
        raise ValueError(f"{source}: dist.backward_passes_per_step must be >= 1")
    if cfg.data.epochs <= 0 and not cfg.optim.max_steps:
        raise ValueError(f"{source}: need data.epochs > 0 or optim.max_steps")
    ModelConfig(**asdict(cfg.model))  # re-runs its own checks


def load_yaml(path: str | Path) -> TrainConfig:
    """Read a YAML config file. Raises ValueError naming the file on parse or schema errors."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from None
    return from_dict(data, str(path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and one ``--field-name`` flag per config field (default: unset)."""
    parser.add_argument("--config", help="YAML config file; flags override its values")
    for section, f, tp in _fields():
        help_text = f.metadata.get("help") or _MODEL_HELP.get(f.name, "")
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + f.name.replace("_", "-")
        if section == "data" and f.name == "shards":
            flag = "--shards"
        parser.add_argument(flag, dest=f"cfg__{section}__{f.name}", default=None,
                            metavar=_base_type(tp).__name__.upper(),
                            choices=f.metadata.get("choices"),
                            help=f"{help_text} [{section}.{f.name}, default {default}]")


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Config from ``--config`` (if given) with every flag the user set applied on top.

    Raises:
        ValueError: as :func:`from_dict`, naming the flag's field.
    """
    cfg = load_yaml(args.config) if getattr(args, "config", None) else TrainConfig()
    data = cfg.to_dict()
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            _, section, name = key.split("__")
            data[section][name] = value
    return from_dict(data, "command line" if not getattr(args, "config", None) else
                     f"{args.config} + command line")


def save_yaml(cfg: TrainConfig, path: str | Path) -> None:
    """Write ``cfg`` as YAML, atomically (temp file + rename)."""
    from hvd_lm.atomic import write_text

    write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
