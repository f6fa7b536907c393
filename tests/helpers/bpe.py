"""A small byte-level BPE tokenizer trained on the spot, with the ChatML special tokens and chat
template (the GGUF conversion tests and the HF tokenizer tests both use one)."""

from __future__ import annotations

import json

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def bpe_tokenizer(texts: list[str], vocab_size: int):
    """A `tokenizers.Tokenizer` trained on `texts` (byte-level, so any text round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return t


def chat_tokenizer_folder(tmp_path, template=CHATML):
    """A tokenizer folder (tokenizer.json + tokenizer_config.json with `template`) in tmp_path."""
    t = bpe_tokenizer(
        ["user: hello world", "assistant: def f(x): return x", "system: be brief"] * 50, vocab_size=300
    )
    t.save(str(tmp_path / "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>",
    }
    if template is not None:
        conf["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    return t
