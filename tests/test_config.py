"""One config: YAML, then flags on top; errors name the file and the field."""
import argparse

import pytest

from hvd_lm.config import add_arguments, from_args, load_yaml


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
        load_yaml(y)
    assert "bad.yaml" in str(e.value)


def test_bad_flag_choice_is_rejected():
    with pytest.raises(SystemExit):
        parse(["--precision", "fp8"])
