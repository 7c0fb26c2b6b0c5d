"""What the README says of YAML configs: ``yes`` is YAML's ``true`` (accepted, cannot be told from
it after parsing); a real typo fails at parse time naming the parameter."""

from __future__ import annotations

import pytest

jsonargparse = pytest.importorskip("jsonargparse")

from lightning_vescale import VeScaleFSDPStrategy  # noqa: E402


def _parse(tmp_path, value: str):
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(VeScaleFSDPStrategy, "strategy")
    path = tmp_path / "c.yaml"
    path.write_text(f"strategy:\n  reshard_after_forward: {value}\n")
    return parser.parse_path(str(path)).strategy.reshard_after_forward


def test_yaml_yes_is_true(tmp_path):
    assert _parse(tmp_path, "yes") is True and _parse(tmp_path, "true") is True


def test_yaml_typo_fails_naming_the_parameter(tmp_path):
    with pytest.raises(Exception, match="reshard_after_forward"):
        _parse(tmp_path, "maybe")
