"""Chat fine-tuning (``training.dataset = "chat"``): a conversation rendered as tokens, and which
of them the model learns.

A conversation is a list of messages ``{"role": ..., "content": ...}``. Only the assistant's
words are labels: the model learns to answer, not to predict the user. The rendering is chosen
by the tokenizer:

* **Llama 3 format**, when the tokenizer has ``<|start_header_id|>``, ``<|end_header_id|>`` and
  ``<|eot_id|>`` (Llama 3 and 3.1 ``tokenizer.json``): the format those models were tuned on,
  token for token what their chat template produces for the same messages (content stripped of
  surrounding whitespace, as the template does, and no implicit system prompt)::

      <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
      <|start_header_id|>assistant<|end_header_id|>\\n\\n{content}<|eot_id|>...

  Labels: each assistant content and the ``<|eot_id|>`` that ends it (the model must learn to
  stop); headers and other roles are masked.
* **ChatML (Qwen3) format**, when the tokenizer has ``<|im_start|>`` and ``<|im_end|>`` (Qwen
  ``tokenizer.json``): what Qwen3's chat template renders, with no BOS and contents as they are::

      <|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n{content}<|im_end|>\n...

  An assistant message's ``<think>...</think>`` part is kept only after the last user message
  (earlier turns lose it, as the template drops it), and the last message, when it is the
  assistant's, opens with a think block (empty without one): the template's rendering of a
  finished conversation. Labels: each assistant body (the think block included) and its
  ``<|im_end|>``; the role line and the newline after ``<|im_end|>`` are masked.
* **Plain format** otherwise (the bundled SentencePiece model, Llama 2): ``[bos]``, then every
  message as ``"{role}: {content}"``; other roles' messages end with a blank line, assistant
  messages with EOS. Labels: each assistant content and its EOS.

Every piece is tokenized on its own (header, content, separator), so that the label boundary is
a token boundary; a BPE merge across a piece boundary in the whole string, which a template
rendered as one string could make, is therefore not made here.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from trainer.data.tokenizer import Tokenizer

ASSISTANT = "assistant"
LLAMA3_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")
THINK = ("<think>", "</think>")


@dataclass(frozen=True)
class Conversation:
    messages: tuple[tuple[str, str], ...]
    """``(role, content)`` pairs in order."""
    where: str
    """``file:line`` (or the play and scene) it came from, for messages about it."""


@dataclass
class ChatStats:
    """What building a chat dataset kept and dropped; stored with the samples, so a cached
    dataset reports the same."""

    conversations: int = 0
    without_assistant: int = 0
    """Dropped: no assistant message, hence nothing to learn."""
    truncated: int = 0
    """Longer than ``seq_len + 1`` tokens: cut on the right (kept if a label survives)."""
    dropped_by_truncation: int = 0
    """Dropped: the cut removed every assistant token."""

    def as_tuple(self) -> tuple[int, ...]:
        return astuple(self)

    @property
    def kept(self) -> int:
        return self.conversations - self.without_assistant - self.dropped_by_truncation

    def describe(self, seq_len: int) -> str:
        dropped = self.without_assistant + self.dropped_by_truncation
        text = f"chat: {self.kept:,} of {self.conversations:,} conversations kept"
        if self.truncated:
            text += f"; {self.truncated:,} cut at `training.seq_len` + 1 = {seq_len + 1} tokens"
        if dropped:
            text += (
                f"; {dropped:,} dropped ({self.without_assistant:,} without an assistant message, "
                f"{self.dropped_by_truncation:,} whose first assistant token lies past the cut: raise "
                "`training.seq_len` to keep them)"
            )
        return text


def uses_llama3_format(tokenizer: Tokenizer) -> bool:
    return _llama3_special_ids(tokenizer) is not None


def _llama3_special_ids(tokenizer: Tokenizer) -> tuple[int, int, int] | None:
    """The ids of ``LLAMA3_SPECIALS``, or None when the tokenizer lacks one of them."""
    start, end, eot = (tokenizer.token_id(piece) for piece in LLAMA3_SPECIALS)
    if start is None or end is None or eot is None:
        return None
    return start, end, eot


def uses_chatml_format(tokenizer: Tokenizer) -> bool:
    return all(tokenizer.token_id(piece) is not None for piece in CHATML_SPECIALS)


def render(messages: tuple[tuple[str, str], ...], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The conversation's tokens and, per token, 1 where it is a label (an assistant token)."""
    if uses_chatml_format(tokenizer):
        return _render_chatml(messages, tokenizer)
    tokens, targets = [tokenizer.bos_id], [0]

    def add(ids: list[int], target: bool) -> None:
        tokens.extend(ids)
        targets.extend([int(target)] * len(ids))

    specials = _llama3_special_ids(tokenizer)
    if specials is not None:
        start, end, eot = specials
        for role, content in messages:
            learn = role == ASSISTANT
            add([start, *tokenizer.encode(role, bos=False, eos=False), end], False)
            add(tokenizer.encode("\n\n", bos=False, eos=False), False)
            add(tokenizer.encode(content.strip(), bos=False, eos=False) + [eot], learn)
    else:
        for role, content in messages:
            learn = role == ASSISTANT
            add(tokenizer.encode(f"{role}: ", bos=False, eos=False), False)
            if learn:
                add(tokenizer.encode(content.strip(), bos=False, eos=True), True)
            else:
                add(tokenizer.encode(content.strip() + "\n\n", bos=False, eos=False), False)
    return tokens, targets


def _render_chatml(messages: tuple[tuple[str, str], ...], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    start, end = (tokenizer.token_id(piece) for piece in CHATML_SPECIALS)
    assert start is not None and end is not None  # uses_chatml_format
    tokens: list[int] = []
    targets: list[int] = []

    def add(ids: list[int], target: bool) -> None:
        tokens.extend(ids)
        targets.extend([int(target)] * len(ids))

    def text(piece: str) -> list[int]:
        return tokenizer.encode(piece, bos=False, eos=False) if piece else []

    def tag(piece: str) -> list[int]:
        token = tokenizer.token_id(piece)
        return [token] if token is not None else text(piece)

    last_query = max((i for i, (role, _) in enumerate(messages) if role == "user"), default=-1)
    for i, (role, content) in enumerate(messages):
        add([start, *text(f"{role}\n")], False)
        if role != ASSISTANT:
            add(text(content) + [end], False)
        else:
            reasoning, answer = _split_thinking(content)
            if i > last_query and (i == len(messages) - 1 or reasoning):
                body = tag(THINK[0]) + text(f"\n{reasoning.strip(chr(10))}\n") + tag(THINK[1]) + text("\n\n")
                add(body + text(answer.lstrip("\n")) + [end], True)
            else:
                add(text(answer) + [end], True)
        add(text("\n"), False)
    return tokens, targets


def _split_thinking(content: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of an assistant message written ``<think>reasoning</think>answer``,
    split as Qwen3's template splits it; ``("", content)`` without a closing tag."""
    if THINK[1] not in content:
        return "", content
    before, _, _ = content.partition(THINK[1])
    answer = content.split(THINK[1])[-1].lstrip("\n")
    return before.rstrip("\n").split(THINK[0])[-1].lstrip("\n"), answer
