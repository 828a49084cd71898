"""Verbatim chat templates of open model families (``tests/data/templates``, sources in
``SOURCES.md`` there) and the tiny tokenizers that carry them, shared by the rollout and the
serving tests."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "data" / "templates"

CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
          "<tool_response>", "</tool_response>")
THINK = ("<think>", "</think>")
LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
          "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
          "<|python_tag|>")
DEEPSEEK = ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
            "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "<think>", "</think>",
            "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>",
            "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>",
            "<\uff5ctool\u2581sep\uff5c>", "<\uff5ctool\u2581outputs\u2581begin\uff5c>",
            "<\uff5ctool\u2581outputs\u2581end\uff5c>", "<\uff5ctool\u2581output\u2581begin\uff5c>",
            "<\uff5ctool\u2581output\u2581end\uff5c>")
BOS, EOS = DEEPSEEK[0], DEEPSEEK[1]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's template and the tokenizer facts the template needs."""

    name: str
    file: str
    specials: tuple[str, ...]
    eos: str
    bos: str | None = None
    pad: str | None = None
    tool_parser: str | None = None
    """The parser the template shows (None: it renders no tools)."""
    reasoning: str | None = None
    """The reasoning parser guessed (None: no reasoning)."""
    refused: str | None = None
    """A ChatFormatError pattern when the family is refused at load."""

    @property
    def template(self) -> str:
        return (TEMPLATES / self.file).read_text()


FAMILIES = (
    Family("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", CHATML, "<|im_end|>",
           pad="<|endoftext|>", tool_parser="hermes"),
    Family("qwen3", "Qwen-Qwen3-0.6B.jinja", CHATML + THINK, "<|im_end|>",
           pad="<|endoftext|>", tool_parser="hermes", reasoning="qwen3"),
    Family("qwq", "Qwen-QwQ-32B.jinja", CHATML + THINK, "<|im_end|>", pad="<|endoftext|>",
           tool_parser="hermes", reasoning="deepseek_r1"),
    Family("qwen3-coder", "Qwen3-Coder.jinja", CHATML, "<|im_end|>", pad="<|endoftext|>",
           tool_parser="qwen3_coder"),
    Family("hermes-3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
           ("<|begin_of_text|>",) + CHATML, "<|im_end|>", bos="<|begin_of_text|>",
           pad="<|endoftext|>", tool_parser="hermes"),
    Family("llama-3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3, "<|eot_id|>",
           bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>", tool_parser="llama3_json"),
    Family("llama-3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3, "<|eot_id|>",
           bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>", tool_parser="llama3_json"),
    Family("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
           ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "</s>", bos="<s>",
           tool_parser="mistral"),
    Family("granite-3.3", "ibm-granite-granite-3.3-2B-Instruct.jinja",
           ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
           "<|end_of_text|>", pad="<|end_of_text|>", tool_parser="granite"),
    Family("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1.jinja", DEEPSEEK, EOS, bos=BOS,
           tool_parser="deepseek_v31", reasoning="qwen3"),
    Family("deepseek-r1-distill", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", DEEPSEEK,
           EOS, bos=BOS, reasoning="deepseek_r1"),
    Family("phi-3.5", "microsoft-Phi-3.5-mini-instruct.jinja",
           ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
           "<|endoftext|>", pad="<|endoftext|>"),
    Family("gemma-2", "google-gemma-2-2b-it.jinja",
           ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<eos>",
           bos="<bos>", pad="<pad>"),
    Family("gpt-oss", "openai-gpt-oss-120b.jinja",
           ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>"), "<|return|>",
           refused="gpt-oss harmony"),
)
"""The families tested (see ``tests/data/templates/SOURCES.md``)."""

BY_NAME = {f.name: f for f in FAMILIES}


@functools.lru_cache(maxsize=None)
def family_tokenizer(name: str):
    """The tiny tokenizer of a family (cached: one per test session)."""
    from ray_xlong.models.tokenizer import build_template_tokenizer

    fam = BY_NAME[name]
    return build_template_tokenizer(fam.template, fam.specials, eos=fam.eos, bos=fam.bos,
                                    pad=fam.pad, vocab_size=320 + len(fam.specials))


QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REAL = {"qwen3": ("qwen3", QWEN_PATTERN), "llama-3.1": ("llama3", LLAMA3_PATTERN)}
"""Families whose real vocabulary a registry package ships (``quicktok-v1``: encoding, split
pattern of the model's tokenizer.json)."""
RENAMED = {"llama-3.1": {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>",
                         128010: "<|python_tag|>"}}
"""Special ids a family names differently from the shipped encoding (quicktok's ``llama3`` is
Llama-3.0's, where these were still reserved; Llama-3.1's tokenizer.json names them)."""


@functools.lru_cache(maxsize=None)
def real_tokenizer(name: str):
    """A HF tokenizer with the family's real vocabulary (ids, merges, specials), built from
    the ``quicktok-v1`` encoding (merges recovered from the BPE ranks, as transformers'
    TikTokenConverter does), carrying the family's verbatim template."""
    import quicktok
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    encoding, pattern = REAL[name]
    enc = quicktok.get_encoding(encoding)
    names = {enc.encode_single_token(s): s for s in enc.special_tokens_set}
    names.update(RENAMED.get(name, {}))
    specials = [names[i] for i in sorted(names)]
    special_ids = set(names)
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab)
             if i not in special_ids}
    to_str = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_str[c] for c in b)

    merges = []
    for tok, rank in ranks.items():
        pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok))
                 if tok[:k] in ranks and tok[k:] in ranks]
        merges += [(a, b, rank) for a, b in sorted(pairs, key=lambda p: (ranks[p[0]],
                                                                          ranks[p[1]]))]
    merges.sort(key=lambda m: m[2])
    tok = Tokenizer(BPE({text(t): r for t, r in ranks.items()},
                        [(text(a), text(b)) for a, b, _ in merges], fuse_unk=False,
                        ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    fam = BY_NAME[name]
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fam.eos, bos_token=fam.bos,
                                  pad_token=fam.pad)
    out.chat_template = fam.template
    return out, enc
