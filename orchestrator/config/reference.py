"""docs/config.md, generated from the config models: every section in YAML order with each key's type as a user
writes it, its default and its description, then TRL's and veRL's names for tide's keys
(orchestrator.config.names). `tide config reference` prints it; tests/orchestrator/test_config.py checks that the
checked-in file is current."""
from __future__ import annotations

import json
import textwrap
import types
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import AfterValidator
from pydantic.fields import FieldInfo

from ckpt_transfer.config import resolve_config_path
from orchestrator.config.schema import LLM_SECTIONS, TideConfig, sections, submodel
from orchestrator.config.names import OTHER_NAMES

REGENERATE = "tide config reference > docs/config.md"


def _is_path(metadata: list[Any]) -> bool:
    return any(isinstance(m, AfterValidator) and m.func is resolve_config_path for m in metadata)


def _bounds(base: str, metadata: list[Any]) -> str:
    """`int >= 1`, `float > 0`, `0 < float <= 1`: a number's constraints around its type."""
    low = next((f"{m.gt} <" for m in metadata if isinstance(m, annotated_types.Gt)),
               next((f"{m.ge} <=" for m in metadata if isinstance(m, annotated_types.Ge)), None))
    high = next((f"< {m.lt}" for m in metadata if isinstance(m, annotated_types.Lt)),
                next((f"<= {m.le}" for m in metadata if isinstance(m, annotated_types.Le)), None))
    if low and high:
        return f"{low} {base} {high}"
    if low:
        value, op = low.split(" ")
        return f"{base} {op.replace('<', '>')} {value}"
    return f"{base} {high}" if high else base


def _value(value: Any) -> str:
    """A value as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def type_text(annotation: Any, metadata: list[Any]) -> str:
    """A field's type as a user writes its value: `int >= 1`, `"cpu" | "cuda"`, `float > 0 | null`, `path`."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a, metadata) for a in get_args(annotation))
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return type_text(base, [*metadata, *extra])
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(_value(v) for v in get_args(annotation))
    if origin is list:
        return f"list of {type_text(get_args(annotation)[0], [])}"
    if origin is dict:
        key, value = get_args(annotation)
        return "mapping" if value is Any else f"mapping of {type_text(key, [])} to {type_text(value, [])}"
    if annotation is str:
        if _is_path(metadata):
            return "path"
        pattern = next((m.pattern for m in metadata if getattr(m, "pattern", None)), None)
        return f"str matching {pattern}" if pattern else "str"
    if annotation in (int, float):
        return _bounds(annotation.__name__, metadata)
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and `<` outside code spans, so that `<name>` is not read as HTML."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts)).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    return "*required*" if field.is_required() else _code(_value(field.get_default(call_default_factory=True)))


def _engines(section: str) -> str:
    top = section.split(".")[0].removesuffix("[]")
    if top in LLM_SECTIONS:
        return "Read with `engine: megatron`."
    return "Read with `engine: jax`." if top == "jax" else "Read by both engines."


def _section_field(section: str) -> FieldInfo:
    model = TideConfig
    *parents, last = section.removesuffix("[]").split(".")
    for part in parents:
        model = submodel(model.model_fields[part.removesuffix("[]")].annotation)[0]
    return model.model_fields[last]


def _section(section: str, model: type) -> Iterator[str]:
    title = f"`{section}`" if section else "Top level"
    yield f"{'#' * (2 + section.count('.'))} {title}\n"
    if section:
        items = " A list; each item has these keys." if section.endswith("[]") else ""
        yield f"{_section_field(section).description}{items} {_engines(section)}\n"
    else:
        llm_only = [f"`{k}`" for k, f in model.model_fields.items() if k in LLM_SECTIONS and submodel(f.annotation)
                    is None]
        yield f"Keys outside any section; {', '.join(llm_only)} only with `engine: megatron`.\n"
    yield "| key | type | default | description |"
    yield "| --- | --- | --- | --- |"
    for name, field in model.model_fields.items():
        if submodel(field.annotation) is None:
            kind = type_text(field.annotation, field.metadata)
            yield f"| `{name}` | {_code(kind)} | {_default(field)} | {_cell(field.description or '')} |"
    yield ""


def _path_keys() -> list[str]:
    return [f"{section}.{name}" if section else name for section, model in sections()
            for name, field in model.model_fields.items()
            if "path" in type_text(field.annotation, field.metadata).split(" | ")]


def _names(source: str) -> Iterator[str]:
    label = "TRL `GRPOConfig`" if source == "TRL" else "veRL"
    yield f"| {label} | tide | note |"
    yield "| --- | --- | --- |"
    for o in OTHER_NAMES:
        if o.source == source:
            yield f"| `{o.name}` | `{o.tide}` | {_cell(o.note)} |"
    yield ""


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, width=116, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


def _intro() -> str:
    llm = ", ".join(f"`{k}`" for k in TideConfig.model_fields if k in LLM_SECTIONS)
    bullets = [
        "**The resolved config**: `tide config show CONFIG [key.path=value ...]` prints it as YAML, every default "
        "filled in and every path absolute, exactly as a run records it in `RUN_DIR/config.yaml` (which `tide "
        "resume` reads).",
        "**Overrides**: `tide run CONFIG key.path=value ...` (and `tide config show`) set keys on top of the file "
        "before validation: `trainer.lr=5e-4`, `iterations=3`, `trainer.kl.coef=0.05`, `'rollout.stop=[\"\\n\"]'`, "
        "list items by index (`rewards.0.weight=0.5`). Values are read as YAML (`true`, `[1, 2]`, `{a: 1}`, "
        "`null`), and numbers in exponent form such as `5e-4` are floats. `RUN_DIR/config.yaml` carries them.",
        "**Engines**: `engine: megatron` (the default) reads every section but `jax`; `engine: jax` reads the "
        f"top-level keys, `jax` and `logging`, and refuses {llm}.",
        "**Paths**: relative paths in a config file resolve against the file's directory, not the working "
        "directory: `model.path` (a directory; a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` stays a hub id), "
        "`model.chat_template` (a .jinja file), the file of a reward function or a tool (`rewards[].fn`, "
        "`agent.tools`: `path/to/file.py:name`; a `package.module:name` of theirs is imported from the installed "
        "packages, the file's directory or the working directory) and the keys of type `path` "
        f"({', '.join(f'`{k}`' for k in _path_keys())}). The resolved config holds them absolute. The command "
        "line's `--run-dir`, the default run directory `runs/<name>` and `jax.compilation_cache_dir` are relative "
        "to the working directory.",
        "**Types**: `null` is YAML's null (`null`, `~` or nothing); `a | b` takes either.",
    ]
    header = ("A run is one YAML file, validated before anything starts: an unknown, missing or invalid key stops "
              "the run with exit code 2 and a message naming the key. An unknown key is answered with the key you "
              "may have meant: a near spelling at its level, the same key in another section, or the tide key for "
              "a TRL or veRL name (the tables at the end).")
    return "\n\n".join([
        "# Config reference",
        _wrap(f"<!-- Generated from the config models by `tide config reference` (orchestrator/config/reference.py): "
              f"do not edit; after changing a field, regenerate with `{REGENERATE}`. -->"),
        _wrap(header),
        "\n".join(_wrap(f"- {b}", "  ") for b in bullets),
    ]) + "\n"


def reference_markdown() -> str:
    lines = [_intro()]
    for section, model in sections():
        lines.extend(_section(section, model))
    lines.append("## TRL and veRL names\n")
    lines.append("The tide key for a setting you know from TRL's `GRPOConfig` (trl 1.16.0, with the transformers "
                 "`TrainingArguments` it extends) or from veRL's PPO trainer config; where the note is empty the "
                 "value carries over as it is.\n")
    lines.extend(_names("TRL"))
    lines.extend(_names("veRL"))
    return "\n".join(lines).rstrip("\n") + "\n"
