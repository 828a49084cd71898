"""Which chat format a model directory or tokenizer speaks: :func:`load_chat_format` reads
``xlong_chat.json`` in the directory, else the tokenizer (a chat template → the template format;
the token format's specials → the token format; else a :class:`ChatFormatError` naming the
directory), after checking the tokenizer fits the model's vocabulary.

The formats themselves live in ``token_format.py`` and ``template_format.py``; their records and
protocols in ``chat.py``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from ray_xlong.rollout.chat import ChatFormat, ChatFormatError
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.rollout.token_format import TokenFormat


def load_chat_format(model_dir: str | pathlib.Path, *, format: str | None = None,
                     tool_parser: str | None = None,
                     reasoning_parser: str | None = None) -> ChatFormat:
    """The chat format of a model directory.

    Args:
        model_dir: a local HF model directory (tokenizer files included).
        format: ``token`` | ``template`` | None (``xlong_chat.json`` in the directory, else
            ``template`` when the tokenizer has a chat template, else ``token`` when it has the
            token format's special tokens).
        tool_parser: vLLM tool parser name for the template format (``tool_calls.PARSERS``);
            None: ``xlong_chat.json``, else guessed from the template.
        reasoning_parser: vLLM reasoning parser name (``qwen3``, ``deepseek_r1``, ...; ``none``
            for no reasoning); None: ``xlong_chat.json``, else guessed from the template.
            (``xlong_chat.json`` may also name one of several chat templates:
            ``template_name``; default ``tool_use``, else ``default``.)

    Raises:
        ChatFormatError: no chat template and no format given (names the directory), a
            tokenizer the format cannot use, or an unknown format / parser.
    """
    from ray_xlong.models.build import load_tokenizer

    path = pathlib.Path(model_dir)
    conf_file = path / "xlong_chat.json"
    conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - name the directory
        raise ChatFormatError(f"model_dir {str(path)!r}: no loadable tokenizer: {exc}") from exc
    check_vocab(path, tokenizer)
    return format_for_tokenizer(tokenizer, format=format or conf.get("format"),
                                tool_parser=tool_parser or conf.get("tool_parser"),
                                reasoning_parser=reasoning_parser or conf.get("reasoning_parser"),
                                template_name=conf.get("template_name"), where=str(path))


def check_vocab(path: pathlib.Path, tokenizer: Any) -> None:
    """Raise :class:`ChatFormatError` when the tokenizer's ids do not fit the model's vocabulary
    (``config.json``: what the engines and the Learner load)."""
    conf_file = path / "config.json"
    if not conf_file.is_file():
        raise ChatFormatError(f"model_dir {str(path)!r}: no config.json (not a HF model dir)")
    conf = json.loads(conf_file.read_text())
    vocab = conf.get("vocab_size") or (conf.get("text_config") or {}).get("vocab_size")
    if vocab is not None and len(tokenizer) > int(vocab):
        raise ChatFormatError(f"model_dir {str(path)!r}: the tokenizer has {len(tokenizer)} ids "
                              f"but the model's vocab_size is {vocab} (config.json): tokenizer "
                              f"and model weights do not belong together")


def format_for_tokenizer(tokenizer: Any, *, format: str | None = None,
                         tool_parser: str | None = None, reasoning_parser: str | None = None,
                         template_name: str | None = None, where: str = "tokenizer"
                         ) -> ChatFormat:
    """The chat format of a loaded tokenizer (see :func:`load_chat_format`)."""
    path = where
    if format is None:
        if getattr(tokenizer, "chat_template", None):
            format = "template"
        elif tokenizer.convert_tokens_to_ids("<|call|>") == 7:
            format = "token"
        else:
            raise ChatFormatError(
                f"model_dir {path!r}: the tokenizer has no chat_template and no chat format "
                f"was given; add a chat template to tokenizer_config.json (or chat_template.jinja)"
                f" or pass format='token' for a tokenizer with the token format's specials")
    if format == "token":
        return TokenFormat(tokenizer)
    if format == "template":
        return TemplateFormat(tokenizer, tool_parser=tool_parser,
                              reasoning_parser=reasoning_parser, template_name=template_name,
                              where=path)
    raise ChatFormatError(f"model_dir {path!r}: format must be 'token' or 'template', "
                          f"got {format!r}")
