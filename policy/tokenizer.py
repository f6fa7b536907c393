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
    def default(cls) -> "CharTokenizer":
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
    """Wraps a Hugging Face `tokenizers` tokenizer.json with the CharTokenizer interface."""

    def __init__(self, tok, eos_id: int | None, bos_id: int | None, pad_id: int | None):
        self.tok, self.eos_id, self.bos_id = tok, eos_id, bos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * (bos and self.bos_id is not None) + ids + [self.eos_id] * (eos and self.eos_id is not None)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_hf_tokenizer(folder) -> HFTokenizer:
    """tokenizer.json (+ special token ids from tokenizer_config.json / config.json)."""
    from tokenizers import Tokenizer
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    tok = Tokenizer.from_file(str(path))

    def token_id(name):
        for fname in ("tokenizer_config.json", "special_tokens_map.json"):
            f = folder / fname
            if f.is_file():
                v = json.loads(f.read_text()).get(name)
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str) and tok.token_to_id(v) is not None:
                    return tok.token_to_id(v)
        cfg = folder / "config.json"
        if cfg.is_file():
            v = json.loads(cfg.read_text()).get(f"{name}_id")
            if isinstance(v, list):
                v = v[0] if v else None
            return v
        return None

    return HFTokenizer(tok, token_id("eos_token"), token_id("bos_token"), token_id("pad_token"))
