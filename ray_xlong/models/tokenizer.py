"""A small byte-level BPE tokenizer trained locally (``tokenizers``), with chat special tokens.

No hub download: the vocabulary is learned from a built-in corpus (the task prompts, tool
results and code snippets of ``ray_xlong.rollout.tasks``) plus any extra texts the caller gives.
Byte-level BPE round-trips any text exactly (code with newlines and indentation included), so a
model's output can always be decoded for parsing; inputs are built by appending token ids, never
by re-tokenizing model output.

Special tokens (ids fixed, in this order, ``0 .. len(SPECIAL_TOKENS)-1``)::

    <|pad|> <|bos|> <|eos|> <|system|> <|user|> <|assistant|> <|tool|>
    <|call|> <|answer|> <|end|> <|summarize|> <|summary|>

Invariants: the same corpus and vocab size give the same vocabulary, token for token (BPE
training is deterministic); special tokens are never split and have the ids above.

``style="chatml"`` / ``"llama3"`` build a tokenizer for the *template* format instead: the
specials of ``models/templates.py`` (``<|im_start|>`` … or ``<|start_header_id|>`` …) at ids
0.., its ``chat_template`` set, and tool-call JSON in the training corpus.
"""

from __future__ import annotations

from typing import Sequence

from ray_xlong.checks import is_int

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
    "<|call|>", "<|answer|>", "<|end|>", "<|summarize|>", "<|summary|>",
)
"""Chat-format special tokens; token ``SPECIAL_TOKENS[i]`` has id ``i``."""

_CORPUS: tuple[str, ...] = (
    "You are a careful agent. Use tools with <|call|> name args <|end|> and finish with "
    "<|answer|> text <|end|>.",
    "Compute the sum. What is 3 plus 4? Call the tool add with two numbers.",
    "add 1 2 add 3 4 add 5 6 add 7 8 add 9 0 answer 10 11 12 13 14 15 16 17 18",
    "lookup key value table the answer is result error unknown tool timed out truncated",
    "write solution.py def add(a, b):\n    return a + b\n",
    "def mul(a, b):\n    return a * b\n\ndef sub(a, b):\n    return a - b\n",
    "import pytest\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "run_tests passed failed tests/test_solution.py ok FAILED PASSED collected items",
    "work step spawn subagent summary of progress so far: done steps remaining steps",
    "Summarize the conversation so far in a few words. Summary: finished steps 1 2 3.",
    "The workspace has files. Write the file, then run the tests. All tests pass.",
)


_TEMPLATE_CORPUS: tuple[str, ...] = (
    '<tool_call>\n{"name": "lookup", "arguments": {"key": 3}}\n</tool_call>',
    '{"name": "add", "parameters": {"a": 3, "b": 4}}; {"name": "work", "parameters": {"step": 1}}',
    '{"type": "function", "function": {"name": "lookup", "description": "The value of a key.", '
    '"parameters": {"type": "object", "properties": {"key": {"type": "integer"}}, '
    '"required": ["key"]}}}',
    "<tool_response>\n47\n</tool_response> # Tools <tools> </tools> Call a tool with system "
    "user assistant ipython Environment: ipython To call a function, respond with JSON",
)


def build_tokenizer(*, vocab_size: int = 512, extra_texts: Sequence[str] = (),
                    style: str = "token"):
    """Train a byte-level BPE tokenizer with :data:`SPECIAL_TOKENS` (deterministic).

    Args:
        vocab_size: target vocabulary size including specials and the 256 byte symbols
            (must be ``>= 256 + len(SPECIAL_TOKENS)``).
        extra_texts: more training text (e.g. a task's prompts).
        style: ``token`` (the token format's specials, no chat template) | ``chatml`` |
            ``llama3`` (``models/templates.py``: specials, chat template, bos / eos / pad).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (``token``: bos ``<|bos|>``, eos
        ``<|eos|>``, pad ``<|pad|>``).
    """
    from transformers import PreTrainedTokenizerFast

    from ray_xlong.models.templates import STYLES

    if style != "token" and style not in STYLES:
        raise ValueError(f"build_tokenizer: style must be 'token' or one of {sorted(STYLES)}, "
                         f"got {style!r}")
    spec = STYLES.get(style)
    specials = SPECIAL_TOKENS if spec is None else spec["specials"]
    corpus = list(_CORPUS) + ([] if spec is None else list(_TEMPLATE_CORPUS))
    tok = _train_bpe("build_tokenizer", corpus + list(extra_texts), specials, vocab_size)
    if spec is None:
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                       eos_token="<|eos|>", pad_token="<|pad|>")
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"],
                                  eos_token=spec["eos"], pad_token=spec["pad"])
    out.chat_template = spec["template"]
    return out


def build_template_tokenizer(template: str, specials: Sequence[str], *, eos: str,
                             bos: str | None = None, pad: str | None = None,
                             vocab_size: int = 400, extra_texts: Sequence[str] = ()):
    """A small byte-level BPE tokenizer carrying a model's own chat template and special
    tokens (ids ``0..len(specials)-1``, in order), for testing a real template without its
    vocabulary (deterministic; trained on the template text and the template corpus).

    Args:
        template: the chat template (Jinja), verbatim.
        specials: the model's special tokens the template uses (end-of-turn included).
        eos, bos, pad: the tokenizer's eos / bos / pad tokens (each one of ``specials``).
        vocab_size: target vocabulary size (``>= 256 + len(specials)``).
        extra_texts: more training text.
    """
    from transformers import PreTrainedTokenizerFast

    for name, token in (("eos", eos), ("bos", bos), ("pad", pad)):
        if token is not None and token not in specials:
            raise ValueError(f"build_template_tokenizer: {name} {token!r} is not one of "
                             f"specials")
    tok = _train_bpe("build_template_tokenizer", [template, *_TEMPLATE_CORPUS, *extra_texts],
                     specials, vocab_size)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                  pad_token=pad)
    out.chat_template = template
    return out


def _train_bpe(caller: str, texts: Sequence[str], specials: Sequence[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` with ``specials`` at ids
    ``0..len(specials)-1`` in order (checked); ``vocab_size`` must leave room for the 256 byte
    tokens (errors name ``caller``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = 256 + len(specials)
    if not is_int(vocab_size) or vocab_size < floor:
        raise ValueError(f"{caller}: vocab_size must be an int >= {floor}, "
                         f"got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    tok.train_from_iterator(list(texts), trainer=trainer)
    for i, special in enumerate(specials):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"special token {special!r} got id {tok.token_to_id(special)}")
    return tok
