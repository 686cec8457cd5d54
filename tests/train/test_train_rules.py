"""The shipped compliance rulesets, and those of a suite of one's own."""

from pathlib import Path

import pytest

from jax_brgemm.train import rulegen
from jax_brgemm.train.compliance import compliance_config


def test_rules_are_generated_from_the_suite():
    assert rulegen.main(["--check"]) == 0


def test_compliance_config_is_an_absolute_path():
    path = Path(compliance_config("mlp"))
    assert path.is_absolute() and path.is_file() and (path.parent / "mlp.yaml").is_file()
    with pytest.raises(ValueError):
        compliance_config("bert")


def test_a_suite_of_ones_own_carries_its_rules(tiny, capsys):
    assert rulegen.main(["--check"], suite=tiny.suite) == 0
    assert Path(compliance_config("tiny", tiny.suite)) == tiny.suite.rules_dir / "common.yaml"
    with pytest.raises(ValueError):
        compliance_config("tiny")  # not in the built-in suite
    (tiny.suite.rules_dir / "tiny.yaml").write_text("# out of date\n")
    assert rulegen.main(["--check"], suite=tiny.suite) == 1
    assert "tiny.yaml" in capsys.readouterr().err
    assert rulegen.main(["--write"], suite=tiny.suite) == 0
    assert rulegen.main(["--check"], suite=tiny.suite) == 0
