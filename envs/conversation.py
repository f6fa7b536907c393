"""The conversation layout of a multi-turn episode, as token text: what the worker tokenises
(prompt, then each observation appended after the ids it generated) and what the warm start
trains on, so both see exactly the same text. Also the Task.spec of a multi-turn task."""

from __future__ import annotations

import dataclasses

from .episode import EpisodeLimits, EpisodeTask


def episode_spec(task: EpisodeTask, limits: EpisodeLimits | None = None) -> dict:
    """Task.spec of a multi-turn task: the EpisodeTask and its limits (JSON/msgpack-able)."""
    return {"episode": task.to_dict(), "limits": dataclasses.asdict(limits or EpisodeLimits())}


class PlainFormat:
    """Conversation layout for tokenizers without a chat template (the char tokenizer). The whole
    conversation is `prompt(messages) + turn_1 + observation(obs_1) + turn_2 + ...`, so its
    tokenisation is defined and equals the stored ids (tests/test_agentic_pipeline.py)."""

    def prompt(self, messages: list[dict]) -> str:
        return "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in messages) + "ASSISTANT:\n"

    def observation(self, obs: str, ended_with_eos: bool) -> str:
        return f"\n\nOBSERVATION:\n{obs}\n\nASSISTANT:\n"


class TemplateFormat:
    """A tokenizer's chat template: the observation's text is what the template puts between the
    end of the assistant turn and the next assistant turn, found by rendering the conversation
    with and without it (the template's end-of-turn text is left out when the model sampled it)."""

    def __init__(self, tok):
        self.tok = tok

    def prompt(self, messages: list[dict]) -> str:
        return self.tok.render_chat(messages, add_generation_prompt=True)

    def observation(self, obs: str, ended_with_eos: bool) -> str:
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        head = self.tok.render_chat(probe, add_generation_prompt=False)
        full = self.tok.render_chat(probe + [{"role": "user", "content": obs}], add_generation_prompt=True)
        if not full.startswith(head):
            raise ValueError(
                "the chat template renders earlier turns differently once a turn follows: "
                "observations cannot be appended as tokens"
            )
        text = full[len(head) :]
        cut = head[head.rindex(_MARK) + len(_MARK) :]  # what the template writes after the assistant text
        eos = self.tok.decode([self.tok.eos_id]) if ended_with_eos and self.tok.eos_id is not None else ""
        return cut[len(eos) :] + text if cut.startswith(eos) else cut + text


_MARK = "@@assistant-turn@@"


def chat_format(tok):
    return TemplateFormat(tok) if getattr(tok, "chat_template", None) else PlainFormat()


def transcript(fmt, messages: list[dict], turns: list[dict]) -> tuple[str, list[tuple[str, bool]]]:
    """(prompt text, [(text, is_model)]) of a played episode in `fmt`: model turns and the
    observations between them, laid out exactly as the worker appends them (no observation after
    the last turn: the episode ended there)."""
    parts: list[tuple[str, bool]] = []
    for i, t in enumerate(turns):
        parts.append((t["action"], True))
        if i + 1 < len(turns):
            parts.append((fmt.observation(t["observation"], False), False))
    return fmt.prompt(messages), parts
