"""Chat templates of the locally built tokenizers (Jinja, as in a HF ``tokenizer_config.json``).

Two families, written after the public templates they imitate (shorter tool preambles, same
structure, so that what holds for them holds for the real ones):

* ``CHATML_TEMPLATE`` — Qwen2.5-style ChatML: ``<|im_start|>role\\n … <|im_end|>\\n``; tools as
  JSON lines inside ``<tools></tools>`` in the system turn; a tool call is
  ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` (Hermes convention, vLLM parser
  ``hermes``); consecutive tool results share one user turn of ``<tool_response>`` blocks. The
  separator ``\\n`` after ``<|im_end|>`` belongs to the *next* turn in a token context.
* ``LLAMA3_TEMPLATE`` — Llama-3.1-style headers: ``<|start_header_id|>role<|end_header_id|>\\n\\n
  … <|eot_id|>``; tools as JSON in the system turn; a tool call is the JSON object
  ``{"name": …, "parameters": {…}}`` (several joined by ``; ``; vLLM parser ``llama3_json``);
  a tool result is an ``ipython`` turn. No separator after ``<|eot_id|>``.
"""

from __future__ import annotations

CHATML_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set sys = 'You are a helpful assistant.' %}"
    "{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + sys }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>\\n{\"name\": <name>, \"arguments\": "
    "<args>}\\n</tool_call>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5-style ChatML with Hermes tool calls (see module docstring)."""

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content | trim %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set sys = '' %}{%- set rest = messages %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- sys }}"
    "{%- if tools %}{{- '\\nTo call a function, respond with JSON {\"name\": function name, "
    "\"parameters\": dictionary of arguments}.\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{- (message.content or '') | trim }}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama-3.1-style headers with JSON tool calls (see module docstring)."""

CHATML_TINY_TEMPLATE = CHATML_TEMPLATE.replace(
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>\\n{\"name\": <name>, \"arguments\": "
    "<args>}\\n</tool_call>' }}{%- endif %}",
    "{%- if tools %}{{- '\\nTools:' }}{%- for tool in tools %}"
    "{{- ' ' + tool.function.name + '(' + (tool.function.parameters.properties | list | "
    "join(', ')) + ')' }}{%- endfor %}{%- endif %}")
"""The ChatML template of the tiny demo model: the same turns and Hermes tool calls, tools
listed as ``Tools: lookup(key)`` (a short prompt keeps the CPU main job within its budget)."""

CHATML_SPECIALS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>",
)
"""Special tokens of the ChatML tokenizer (ids 0..6); pad ``<|endoftext|>``, eos ``<|im_end|>``."""

LLAMA3_SPECIALS: tuple[str, ...] = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
)
"""Special tokens of the Llama-3-style tokenizer (ids 0..7); bos ``<|begin_of_text|>``, eos
``<|eot_id|>``, pad ``<|finetune_right_pad_id|>``."""

STYLES: dict[str, dict] = {
    "chatml": dict(specials=CHATML_SPECIALS, template=CHATML_TEMPLATE, bos=None,
                   eos="<|im_end|>", pad="<|endoftext|>", tool_parser="hermes"),
    "chatml_tiny": dict(specials=CHATML_SPECIALS, template=CHATML_TINY_TEMPLATE, bos=None,
                        eos="<|im_end|>", pad="<|endoftext|>", tool_parser="hermes"),
    "llama3": dict(specials=LLAMA3_SPECIALS, template=LLAMA3_TEMPLATE, bos="<|begin_of_text|>",
                   eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", tool_parser="llama3_json"),
}
"""Tokenizer styles with a chat template: specials, template, bos / eos / pad, tool parser."""
