"""Chat templates for GGUF files that carry none (`tokenizer.chat_template` absent).

Without one, /v1/chat/completions would refuse the model. For the families whose turn
format is fixed and public we supply it: Gemma 2/3's `<start_of_turn>role ... <end_of_turn>`
(the format of Google's instruction-tuned checkpoints; a base model was not trained on it,
so its replies are what a base model does with it). The turn's end token joins the EOS ids,
as the instruction-tuned models' generation configs list it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Google's Gemma template, text content only: a system message is folded into the first
# user turn (Gemma has no system role), "assistant" is written "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


@dataclass(frozen=True)
class DefaultChat:
    """A family's chat template and the token that ends a turn (an extra EOS)."""
    template: str
    end_of_turn: str


# GGUF general.architecture -> its default chat format.
DEFAULT_CHATS: dict[str, DefaultChat] = {
    "gemma2": DefaultChat(GEMMA_CHAT_TEMPLATE, "<end_of_turn>"),
    "gemma3": DefaultChat(GEMMA_CHAT_TEMPLATE, "<end_of_turn>"),
}
