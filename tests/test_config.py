"""One config: YAML, then flags on top; errors name the file and the field."""
import argparse

import pytest

from hvd_lm import options
from hvd_lm.train.settings import TrainConfig, add_arguments, from_args


def parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv))


def test_yaml_then_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model: {hidden_size: 512}\noptim: {lr_rule: sqrt, lr: 1.0e-3}\n"
                 "dist: {compression: none}\n")
    cfg = parse(["--config", str(y), "--hidden-size", "1024", "--batch-size", "4",
                 "--lr-cap", "3e-3", "--verify-shards", "false"])
    assert cfg.model.hidden_size == 1024          # flag beats YAML
    assert cfg.optim.lr_rule == "sqrt" and cfg.optim.lr == 1e-3  # YAML kept
    assert cfg.dist.compression == "none"
    assert cfg.data.batch_size == 4 and cfg.optim.lr_cap == 3e-3
    assert cfg.data.verify_shards is False
    assert parse([]).dist.compression == "fp16"   # the reference's default


@pytest.mark.parametrize("text,match", [
    ("optim: {lr_rule: cubic}", r"optim\.lr_rule"),
    ("model: {hidden: 3}", r"unknown field model\.hidden"),
    ("modle: {}", "unknown section 'modle'"),
    ("data: {batch_size: many}", r"data\.batch_size: expected int"),
    ("data: [1, 2", "invalid YAML"),
])
def test_errors_name_file_and_field(tmp_path, text, match):
    y = tmp_path / "bad.yaml"
    y.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        options.load_yaml(TrainConfig, y)
    assert "bad.yaml" in str(e.value)


def test_bad_flag_choice_is_rejected():
    with pytest.raises(SystemExit):
        parse(["--precision", "fp8"])


# ---- the generic mechanism (hvd_lm.options) every command uses ------------------------------

from dataclasses import dataclass, field  # noqa: E402

from hvd_lm import options as C  # noqa: E402


@dataclass
class _Inner:
    rate: float = C.option(1.0, "a rate", gt=0)
    sizes: list[int] = C.option(default_factory=lambda: [1, 2], help="sizes", ge=1)


@dataclass
class _Tree:
    name: str = C.option("", "a name", positional=True, required=True)
    inner: _Inner = field(default_factory=_Inner)
    keep: bool = C.option(True, "keep (--drop: no)", switch=False, flag="--drop")
    mode: str = C.option("a", "mode", choices=("a", "b"))
    limit: int | None = C.option(None, "limit", ge=1)

    def check(self):
        if self.mode == "b" and self.limit is None:
            raise ValueError("mode b needs a limit")


def _parse(argv):
    p = argparse.ArgumentParser()
    C.add_arguments(p, _Tree)
    return C.from_args(_Tree, p.parse_args(argv))


def test_flags_yaml_and_round_trip(tmp_path):
    cfg = _parse(["x", "--rate", "2.5", "--sizes", "3,4", "--drop", "--mode", "b",
                  "--limit", "7"])
    assert (cfg.name, cfg.inner.rate, cfg.inner.sizes, cfg.keep, cfg.limit) == \
        ("x", 2.5, [3, 4], False, 7)
    assert _parse(C.to_argv(cfg)) == cfg          # to_argv is the inverse of the flags
    C.save_yaml(cfg, tmp_path / "t.yaml")
    assert C.load_yaml(_Tree, tmp_path / "t.yaml") == cfg


@pytest.mark.parametrize("argv,match", [
    (["x", "--rate", "0"], r"inner\.rate must be > 0"),
    (["x", "--rate", "nan"], r"inner\.rate must be a finite number"),
    (["x", "--sizes", "1,0"], r"inner\.sizes must be >= 1"),
    (["x", "--limit", "1.5"], r"limit: expected int"),
    (["x", "--mode", "b"], "mode b needs a limit"),
    ([], r"name is required \(argument NAME\)"),
])
def test_bad_values_name_the_field(argv, match):
    with pytest.raises(C.ConfigError, match=match):
        _parse(argv)


def test_yaml_types_are_strict(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("inner: {sizes: true}\n")
    with pytest.raises(C.ConfigError, match=r"t\.yaml: inner\.sizes: expected int"):
        C.load_yaml(_Tree, y)
    with pytest.raises(C.ConfigError, match="cannot read the config file"):
        C.load_yaml(_Tree, tmp_path / "missing.yaml")


def test_command_turns_errors_into_one_line(capsys):
    def run(cfg):
        if cfg.name == "boom":
            raise RuntimeError("it broke")
        if cfg.name == "bad":
            raise KeyError("no such thing")
        return 0

    cmd = C.Command(_Tree, run, usage_errors=(KeyError,))
    assert cmd.main(["ok"], "prog") == 0
    assert cmd.main(["boom"], "prog") == 1
    assert cmd.main(["bad"], "prog") == 2
    assert cmd.main(["x", "--rate", "-1"], "prog") == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["prog: ERROR: it broke", "prog: ERROR: no such thing",
                   "prog: ERROR: command line: inner.rate must be > 0, got -1.0 (--rate)"]


def test_a_c_grid_from_yaml_is_a_list_of_numbers_and_never_empty():
    """A C grid in YAML as quoted numbers (["0.5", "1"]) is (0.5, 1.0), as on the command line
    (before: ((0.5,), (1.0,)), which the demo accepted and the solver crashed on); an empty grid
    (c_grid: [] or baseline_c_grid: []) is refused when the settings are read, naming it (before:
    after the featurization, or after the whole fit)."""
    from hvd_lm.options.tree import ConfigError, from_dict, validate
    from hvd_lm.transfer.run import TransferConfig

    assert from_dict(TransferConfig, {"checkpoint": "x", "c_grid": ["0.5", "1"]}).c_grid == \
        (0.5, 1.0)
    assert from_dict(TransferConfig, {"checkpoint": "x", "c_grid": ["0.5,2", 4]}).c_grid == \
        (0.5, 2.0, 4.0)
    for key in ("c_grid", "baseline_c_grid"):
        with pytest.raises(ConfigError, match=f"{key} is empty"):
            validate(from_dict(TransferConfig, {"checkpoint": "x", key: []}))
