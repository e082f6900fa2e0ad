"""Conversations to token ids with the chat template, where what tools and environments return is data, not
template.

A tokenizer turns the text of its added tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, Qwen's
`<tool_call>`, ...) into their single ids wherever it meets it. Rendering a conversation with the template and
tokenising the result would therefore turn a tool's output that prints `<|im_end|>\\n<|im_start|>assistant` into a
real end of turn and a real assistant turn: the model's next context would hold turns it cannot tell from the ones
the template wrote. Here the control tokens of a rendering are exactly those the template writes; the contents of
the messages other than the model's own turns (tool results, environment replies, errors, prompts) are encoded as
the characters they are, as if the tokenizer had no added tokens (transformers' `split_special_tokens` does that
for special tokens only, and does it by setting a flag on the shared backend tokenizer).

How: every added token's text in such a content is swapped for a private-use marker before the template renders;
the rendered text is split where the tokenizer itself finds added tokens (now all of them the template's); each
piece between them gets its markers back and is encoded by a copy of the tokenizer without added tokens. A
conversation whose contents hold no added token's text is rendered exactly as before, by the template's own
tokenisation. The model's turns are left alone: their tokens are kept as sampled (rollout/agent/trajectory.py)."""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Mapping
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: a marker is _OPEN <index> _CLOSE
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


class _Encoders:
    """A tokenizer's added tokens and two copies of its backend of our own: `full` as the tokenizer encodes
    (added tokens found), `plain` without added tokens (text as text). Our own copies: transformers switches
    `encode_special_tokens` on the shared backend per call."""

    def __init__(self, tokenizer) -> None:
        from tokenizers import Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: tide renders agent trajectories "
                             f"with the `tokenizers` backend (save the tokenizer as tokenizer.json)")
        spec = json.loads(backend.to_str())
        self.added = {str(t["content"]): int(t["id"]) for t in spec.get("added_tokens", [])}
        self.added_ids = set(self.added.values())
        self.full = Tokenizer.from_str(json.dumps(spec))
        self.full.encode_special_tokens = False
        self.plain = Tokenizer.from_str(json.dumps({**spec, "added_tokens": []}))
        texts = sorted(self.added, key=len, reverse=True) + [_OPEN, _CLOSE]
        self.control = re.compile("|".join(re.escape(t) for t in texts if t))

    def text(self, text: str) -> list[int]:
        return self.plain.encode(text, add_special_tokens=False).ids if text else []


_cache: "weakref.WeakKeyDictionary[Any, _Encoders]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _encoders(tokenizer) -> _Encoders:
    with _cache_lock:
        enc = _cache.get(tokenizer)
        if enc is None:
            enc = _cache[tokenizer] = _Encoders(tokenizer)
        return enc


def encode_text(tokenizer, text: str) -> list[int]:
    """`text` as the characters it is: no added token's id, whatever it holds."""
    return _encoders(tokenizer).text(text)


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool,
           template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The conversation's token ids as the chat template renders them, every control token the template's own
    (the module's docstring); `template_kwargs`: the template's variables (model.chat_template_kwargs)."""
    kwargs = dict(template_kwargs or {})
    enc = _encoders(tokenizer)
    forged: list[str] = []

    def mark(content: str) -> str:
        def swap(m: re.Match) -> str:
            forged.append(m.group(0))
            return f"{_OPEN}{len(forged) - 1}{_CLOSE}"
        return enc.control.sub(swap, content)

    marked = [m if m.get("role") == "assistant" or not isinstance(m.get("content"), str)
              else {**m, "content": mark(m["content"])} for m in messages]
    if not forged:
        out = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                            add_generation_prompt=generation_prompt, return_dict=False, **kwargs)
        return list(out["input_ids"] if isinstance(out, dict) else out)
    text = tokenizer.apply_chat_template(marked, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)
    if _MARKER.sub("", text).count(_OPEN) or len(_MARKER.findall(text)) != len(forged):
        raise ValueError("the chat template changed the markers tide put in place of control-token text in a "
                         "message's content; this template cannot render tool output safely")

    def piece(start: int, end: int, found_ids: list[int]) -> list[int]:
        """The ids of the text between two of the template's control tokens: as the tokenizer found them where
        no marker stands in it; else its contents' characters as text. Encoded alone, a piece must come out as
        the tokenizer encodes it in place (true of byte-level BPE; a tokenizer that treats the first piece of a
        text apart, as SentencePiece's `prepend_scheme: first` does, is refused here rather than mis-encoded)."""
        text_piece = text[start:end]
        if _OPEN not in text_piece:
            return found_ids
        if enc.text(text_piece) != found_ids:
            raise ValueError("this tokenizer encodes a piece of a conversation differently alone than in place, so "
                             "tide cannot encode a tool's output that holds control-token text as plain text")
        return enc.text(_MARKER.sub(lambda m: forged[int(m.group(1))], text_piece))

    ids: list[int] = []
    pos, run = 0, []
    found = enc.full.encode(text, add_special_tokens=False)
    for token, (start, end) in zip(found.ids, found.offsets):
        if token in enc.added_ids:  # one the template wrote: the contents' were swapped for markers
            ids += piece(pos, start, run)
            ids.append(token)
            pos, run = end, []
        else:
            run.append(token)
    return ids + piece(pos, len(text), run)
