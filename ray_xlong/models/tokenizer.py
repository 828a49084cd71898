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
"""

from __future__ import annotations

from typing import Sequence

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


def default_corpus() -> tuple[str, ...]:
    """The built-in training texts (chat instructions, arithmetic, code, tool output)."""
    return _CORPUS


def build_tokenizer(*, vocab_size: int = 512, extra_texts: Sequence[str] = ()):
    """Train a byte-level BPE tokenizer with :data:`SPECIAL_TOKENS` (deterministic).

    Args:
        vocab_size: target vocabulary size including specials and the 256 byte symbols
            (must be ``>= 256 + len(SPECIAL_TOKENS)``).
        extra_texts: more training text (e.g. a task's prompts).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (bos ``<|bos|>``, eos ``<|eos|>``, pad
        ``<|pad|>``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < floor:
        raise ValueError(f"build_tokenizer: vocab_size must be an int >= {floor}, "
                         f"got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    tok.train_from_iterator(list(_CORPUS) + list(extra_texts), trainer=trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"special token {special!r} got id {tok.token_to_id(special)}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>")
