"""Tokenizers: a built-in character tokenizer for the built-in tasks, and HF `tokenizers` files."""

from __future__ import annotations

import json
from pathlib import Path


class CharTokenizer:
    """pad=0, bos=1, eos=2, then one id per printable ASCII char (space..~) and newline."""

    pad_id, bos_id, eos_id = 0, 1, 2
    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer chars must be unique")
        self.chars = chars
        self.stoi = {ch: i + len(self.SPECIALS) for i, ch in enumerate(chars)}
        self.vocab_size = len(self.SPECIALS) + len(chars)

    @classmethod
    def default(cls) -> CharTokenizer:
        return cls("".join(chr(c) for c in range(32, 127)) + "\n")

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self.stoi[ch] for ch in text]
        except KeyError:
            bad = sorted({ch for ch in text if ch not in self.stoi})
            raise ValueError(f"characters not in the CharTokenizer vocab: {bad[:10]!r}") from None
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids) -> str:
        """Special ids are dropped; ids outside the vocab raise."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside [0, {self.vocab_size}): {bad[:10]}")
        n = len(self.SPECIALS)
        return "".join(self.chars[i - n] for i in ids if i >= n)


class HFTokenizer:
    """Wraps a Hugging Face `tokenizers` tokenizer.json with the CharTokenizer interface, plus the
    model's chat template (Jinja, as in tokenizer_config.json) when it has one."""

    def __init__(
        self,
        tok,
        eos_id: int | None,
        bos_id: int | None,
        pad_id: int | None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        self.tok, self.eos_id, self.bos_id = tok, eos_id, bos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ...: the template sees them
        self._template = None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """With bos, a text that already starts with the bos token (a chat template that writes it,
        or ChatML's <|im_start|> where that is the bos) does not get a second one."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        bos = bos and self.bos_id is not None and not (ids and ids[0] == self.bos_id)
        return [self.bos_id] * bos + ids + [self.eos_id] * (eos and self.eos_id is not None)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat template applied to messages ([{"role", "content"}, ...]) -> prompt text."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                "or chat_template.jinja)"
            )
        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': ...} dicts")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **extra},
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra
    ) -> list[int]:
        """Token ids of the rendered chat; markup like <|im_start|> encodes to its single special id."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra))


def _compile_template(source: str):
    """Templates ship with checkpoints, i.e. are untrusted: a sandboxed environment, with the
    whitespace settings and helpers chat templates are written for."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: (
        json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    )
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from e


_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def load_hf_tokenizer(folder) -> HFTokenizer:
    """A folder's tokenizer.json (the folder, or that file's path) with special tokens and chat
    template from tokenizer_config.json / special_tokens_map.json / chat_template.jinja / config.json."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    if folder.is_file():  # the tokenizer.json itself: its folder holds the rest
        folder = folder.parent
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    tok = Tokenizer.from_file(str(path))
    configs = []
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        f = folder / fname
        if f.is_file():
            try:
                configs.append(json.loads(f.read_text()))
            except ValueError as e:
                raise ValueError(f"{f} is not valid JSON: {e}") from e

    def token_str(name):
        for c in configs:
            v = c.get(name)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and tok.token_to_id(v) is not None:
                return v
        return None

    def token_id(name):
        if token_str(name) is not None:
            return tok.token_to_id(token_str(name))
        cfg = folder / "config.json"
        if cfg.is_file():
            v = json.loads(cfg.read_text()).get(f"{name}_id")
            if isinstance(v, list):
                v = v[0] if v else None
            return v
        return None

    template = None
    jinja_file = folder / "chat_template.jinja"  # transformers >= 4.43 may write it beside the config
    if jinja_file.is_file():
        template = jinja_file.read_text()
    else:
        for c in configs:
            t = c.get("chat_template")
            if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
                t = next((x.get("template") for x in t if x.get("name") == "default"), None)
            if isinstance(t, str):
                template = t
                break
    specials = {n: token_str(n) for n in _SPECIAL_NAMES if token_str(n) is not None}
    return HFTokenizer(
        tok,
        token_id("eos_token"),
        token_id("bos_token"),
        token_id("pad_token"),
        chat_template=template,
        special_tokens=specials,
    )


def load_tokenizer(spec: str):
    """The tokenizer trainer and workers share: "char" (CharTokenizer) or a tokenizer.json path /
    HF folder (load_hf_tokenizer)."""
    return CharTokenizer.default() if spec == "char" else load_hf_tokenizer(spec)
