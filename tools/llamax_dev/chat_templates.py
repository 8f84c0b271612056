"""Chat templates the tests and benchmarks apply to SmolLM2 with
``chat_template=`` (our own text, in the shapes real models use)."""

# Hermes / Qwen 2.5 style: tools listed in a system turn, calls written as
# <tool_call> JSON blocks, assistant calls and tool results rendered back.
HERMES = """{%- if tools %}<|im_start|>system
You can call functions. Their signatures:
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}To call one, write <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments }}}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A generation prompt that opens a reasoning section (Qwen 3 / DeepSeek R1 style).
THINKING = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
