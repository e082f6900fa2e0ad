"""What a value given where the config expects a section was probably meant for: `trainer.kl: 0.05` (or the
override `trainer.kl=0.05`) is answered with `trainer.kl.coef`, the one field of the section that takes the value;
where several do (or none), the section's fields are listed. Used by orchestrator.config.schema's messages."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


def _takes(model: type[BaseModel], name: str, value: Any) -> bool:
    """Whether the section's field `name` accepts `value` on its own (the section's other fields left out)."""
    try:
        model.model_validate({name: value})
    except ValidationError as err:
        return not any(e["loc"][:1] == (name,) for e in err.errors())
    return True


def section_value_hint(path: str, model: type[BaseModel], value: Any) -> str:
    """The message for `value`, a scalar or a list, given at `path` where the section `model` is expected."""
    fields = list(model.model_fields)
    taking = [name for name in fields if _takes(model, name, value)]
    head = f"{path}: a section, not a value (got {value!r})"
    listed = f"{path}'s fields: {', '.join(fields)}"
    if len(taking) == 1:
        return f"{head}; did you mean {path}.{taking[0]}? ({listed})"
    return f"{head}; set its fields by name ({listed})"
