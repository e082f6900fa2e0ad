"""Config messages of issue 59: a value given for a section is answered with the field it was meant for (or the
section's fields), TRL's gradient_accumulation_steps with what tide does instead, and the resolved config of a
run with a model.path holds no `model.tiny` (which such a run never reads) and loads back as it was."""
from __future__ import annotations

import pytest
import yaml

from orchestrator.config.schema import ConfigError, dump_config, load_config, parse_config, parse_overrides


def _load(tmp_path, data: dict, *overrides: str):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "m", "iterations": 1, **data}))
    return load_config(path, parse_overrides(list(overrides)))


def _error(tmp_path, data: dict, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, data, *overrides)
    return str(e.value)


@pytest.mark.parametrize("override, message", [
    ("trainer.kl=0.05", "trainer.kl: a section, not a value (got 0.05); did you mean trainer.kl.coef? "
                        "(trainer.kl's fields: coef, estimator)"),
    ("trainer.lr_schedule=cosine", "trainer.lr_schedule: a section, not a value (got 'cosine'); did you mean "
                                   "trainer.lr_schedule.decay?"),
    # several fields take a number: none is guessed, the fields are listed
    ("trainer.parallel=2", "trainer.parallel: a section, not a value (got 2); set its fields by name "
                           "(trainer.parallel's fields: dp, tp, pp, ep)"),
])
def test_a_value_for_a_section_names_the_field_meant(tmp_path, override, message):
    assert message in _error(tmp_path, {}, override)


def test_gradient_accumulation_steps_is_answered_with_what_tide_does(tmp_path):
    """tide has no accumulation count: an optimizer step accumulates over all its samples' micro-batches, so the
    count follows from trainer.updates_per_iteration (and micro_batch_size); the hint says so, not `did you mean
    trainer.micro_batch_size`, which sets the micro-batch's size."""
    from orchestrator.config.reference import reference_markdown

    message = _error(tmp_path, {"gradient_accumulation_steps": 4})
    assert ("gradient_accumulation_steps: unknown field; did you mean trainer.updates_per_iteration (TRL's "
            "gradient_accumulation_steps: no key of its own: an optimizer step takes rollout.prompts_per_iteration "
            "x n_samples / trainer.updates_per_iteration samples and accumulates gradients over all of them") in message
    assert "micro_batch_size (TRL's" not in message
    row = next(line for line in reference_markdown().splitlines() if line.startswith("| `gradient_accumulation_steps`"))
    assert row.startswith("| `gradient_accumulation_steps` | `trainer.updates_per_iteration` | no key of its own: ")


def test_resolved_config_with_a_model_path_leaves_the_tiny_model_out(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    cfg = _load(tmp_path, {"model": {"path": str(model), "tiny": {"hidden_size": 128}}})
    dumped = dump_config(cfg)
    assert "tiny" not in yaml.safe_load(dumped)["model"]
    (tmp_path / "run.yaml").write_text(dumped)  # RUN_DIR/config.yaml, as `tide resume` reads it back
    again = load_config(tmp_path / "run.yaml")
    assert again.model.path == str(model) and dump_config(again) == dumped
    tiny = _load(tmp_path, {"model": {"tiny": {"hidden_size": 128}}})  # no path: the tiny model is the run's
    assert yaml.safe_load(dump_config(tiny))["model"]["tiny"]["hidden_size"] == 128
    assert parse_config(yaml.safe_load(dump_config(tiny))) == tiny
