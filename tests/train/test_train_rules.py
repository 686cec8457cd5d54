"""The shipped compliance rulesets."""

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
