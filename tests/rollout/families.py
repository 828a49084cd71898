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
