"""Chat records into token ids and a loss mask: a conversation is rendered with the tokenizer's
chat template (jinja2, in a sandbox, as ``transformers`` renders it) and only the turns of the
source's ``train_roles`` are trained on.

Which characters belong to a trained turn:

- a template with ``{% generation %}`` blocks (the convention of ``transformers``'
  ``return_assistant_tokens_mask``) marks them itself, when only assistant turns are trained;
- otherwise each trained message is found by rendering the conversation up to it: its span runs
  to the end of the conversation including it, from the end of the conversation before it with
  the generation prompt (an assistant turn: its role header is a prompt, not an answer), or, for
  other roles, from where its content begins in its rendered turn (the turn's header is never
  trained).

A token is trained when its characters overlap a trained span (tokenizers that report character
offsets); other tokenizers encode the rendered text span by span. The template's output carries
the document's boundaries (BOS, end-of-turn tokens), so chat sources add none by default.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from contextlib import contextmanager
from datetime import datetime, timezone

import numpy as np

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
FIXED_NOW = datetime(2024, 7, 26, tzinfo=timezone.utc)
"""What ``strftime_now`` renders: a fixed date, so the same plan gives the same tokens any day."""


class ChatError(ValueError):
    """A conversation that cannot be rendered as the source asks; the caller names the record."""


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template in a sandboxed jinja2 environment with the globals chat templates use."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: records where its output lands in the text."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            out = caller()
            stack = getattr(_TRACK, "stack", None)
            if stack:
                blocks, spans = stack[-1]
                start = sum(map(len, blocks))
                spans.append((start, start + len(out)))
            return out

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=FIXED_NOW.strftime)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatError(f"chat template does not compile: line {err.lineno}: {err.message}") from None


_TRACK = threading.local()  # per thread: the (rendered blocks, spans) of the render in progress


@contextmanager
def _tracking(blocks: list, spans: list):
    stack = _TRACK.__dict__.setdefault("stack", [])
    stack.append((blocks, spans))
    try:
        yield
    finally:
        stack.pop()


def render(
    template, messages: list[dict], specials: dict, add_generation_prompt: bool = False, spans: list | None = None
) -> str:
    """The template's text for ``messages`` (``spans`` collects its generation blocks)."""
    import jinja2

    blocks: list[str] = []
    try:
        with _tracking(blocks, spans if spans is not None else []):
            for part in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **specials):
                blocks.append(part)
    except jinja2.exceptions.TemplateError as err:
        raise ChatError(f"chat template failed: {err}") from None
    return "".join(blocks)


def trained_spans(
    template_source: str, messages: list[dict], train_roles: list[str], specials: dict
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the loss sees."""
    template = compile_template(template_source)
    if train_roles == ["assistant"] and GENERATION_TAG.search(template_source):
        spans: list = []
        text = render(template, messages, specials, spans=spans)
        return text, [s for s in spans if s[1] > s[0]]
    text = render(template, messages, specials)
    out = []
    for k, m in enumerate(messages):
        if m["role"] not in train_roles:
            continue
        assistant = m["role"] == "assistant"
        before = render(template, messages[:k], specials, add_generation_prompt=assistant) if k or assistant else ""
        upto = render(template, messages[: k + 1], specials)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ChatError(
                f"the chat template does not render message {k} as a prefix of the conversation, so its turn "
                "cannot be told apart: add {% generation %} blocks around assistant answers"
            )
        start = len(before)
        content = m.get("content")
        if not assistant and isinstance(content, str) and content.strip():
            at = upto.find(content.strip(), start)
            start = at if at >= 0 else start
        if len(upto) > start:
            out.append((start, len(upto)))
    return text, out


def check_messages(messages, roles: list[str], train_roles: list[str]) -> list[dict]:
    """The messages as plain dicts, or a ChatError saying what is wrong with them."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("no messages")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatError(f"message {k} is not a {{role, content}} mapping")
        if m["role"] not in roles:
            raise ChatError(f"message {k} has role {m['role']!r}, not one of {roles}")
        out.append({key: v for key, v in m.items() if v is not None})
    if not any(m["role"] in train_roles for m in out):
        raise ChatError(f"no turn to train on (no message of roles {train_roles})")
    return out


def mask_of(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 where its ``[start, end)`` characters overlap a span."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for a, b in spans:
        mask[(offsets[:, 0] < b) & (offsets[:, 1] > a)] = 1
    return mask


def encode_rendered(tok, rendered: list[tuple[str, list]]) -> list[tuple[list[int], np.ndarray]]:
    """Ids and mask of rendered conversations (text, trained spans), encoded in one batch where
    the tokenizer reports character offsets (the Rust batch encoder runs on every core)."""
    encoded = tok.encode_offsets_batch([t for t, _ in rendered]) if rendered else []
    if encoded is not None and all(e is not None for e in encoded):
        return [(list(ids), mask_of(offsets, spans)) for (ids, offsets), (_, spans) in zip(encoded, rendered)]
    return [_by_spans(tok, text, spans) for text, spans in rendered]


def _by_spans(tok, text: str, spans: list) -> tuple[list[int], np.ndarray]:
    """A tokenizer without offsets: the text encoded span by span."""
    ids, mask, at = [], [], 0  # span by span: the trained spans and what lies between them
    cuts = [(a, b, 1) for a, b in spans]
    pieces = []
    for a, b, m in cuts:
        if a > at:
            pieces.append((text[at:a], 0))
        pieces.append((text[a:b], m))
        at = b
    if at < len(text):
        pieces.append((text[at:], 0))
    encoded = tok.encode([p for p, _ in pieces]) if pieces else []
    for (_, m), e in zip(pieces, encoded):
        ids.extend(e)
        mask.extend([m] * len(e))
    return ids, np.asarray(mask, dtype=np.uint8)
