"""HF checkpoints: load Llama/Qwen2 folders (single file and sharded) with the real loader and
compare logits with `transformers`; our save loads back in both; tokenizer.json files."""
import json

import pytest
import torch

from policy import (CharTokenizer, ModelConfig, SamplingConfig, Transformer, generate, hf_name_map,
                    load_hf_checkpoint, load_hf_tokenizer, save_hf_checkpoint)
from policy.tokenizer import HFTokenizer




transformers = pytest.importorskip("transformers")


def hf_model(kind: str, tie=False):
    torch.manual_seed(0)
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie)
    if kind == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():      # HF inits biases to 0: make them matter
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return m.eval()


@pytest.mark.parametrize("kind,tie,shard", [("qwen2", False, None), ("qwen2", True, "60KB"), ("llama", False, "60KB")])
def test_load_hf_checkpoint_matches_transformers(tmp_path, kind, tie, shard):
    ref = hf_model(kind, tie)
    kw = {"max_shard_size": shard} if shard else {}
    ref.save_pretrained(tmp_path, safe_serialization=True, **kw)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg, ours = load_hf_checkpoint(tmp_path)
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.tie_embeddings == tie and cfg.n_kv_heads == 2
    idx = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), ref(idx).logits.float(), atol=1e-4, rtol=1e-4)


def test_our_save_loads_in_transformers_and_back(tmp_path):
    torch.manual_seed(1)
    ours = Transformer(ModelConfig.tiny(vocab_size=99, qkv_bias=True, max_seq_len=64)).eval()
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    save_hf_checkpoint(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg, back = load_hf_checkpoint(tmp_path)
    assert cfg == ours.cfg
    idx = torch.randint(3, 99, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ref(idx).logits.float(), ours(idx), atol=1e-4, rtol=1e-4)
        assert torch.equal(back(idx), ours(idx))
    # the name map names exactly the tensors in the file
    from safetensors.torch import load_file
    assert set(hf_name_map(cfg).values()) == set(load_file(str(tmp_path / "model.safetensors")))
    # a loaded checkpoint generates with the KV cache like any of our models
    out = generate(back, [[5, 6, 7]], SamplingConfig(0.0), 5)
    assert len(out[0].ids) == 5


def test_bad_checkpoints_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    ours = Transformer(ModelConfig.tiny(vocab_size=50, max_seq_len=32))
    save_hf_checkpoint(ours, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(ValueError, match="lacks"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "head_dim": 16}))
    with pytest.raises(ValueError, match="wrong shape"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="MLA"):
        save_hf_checkpoint(Transformer(ModelConfig.tiny(attn="mla", max_seq_len=32)), tmp_path / "mla")


def test_tokenizers(tmp_path):
    tok = CharTokenizer.default()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 99)
    text = "def f(x):\n    return x*2  # ok ~"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == text
    with pytest.raises(ValueError, match="not in the CharTokenizer vocab"):
        tok.encode("naïve")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([5, 400])
    # a real tokenizer.json made with the `tokenizers` package, loaded like a model folder's
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["hello world", "12+7=19", "def f(x): return x"] * 50,
                          trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf = load_hf_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer) and hf.eos_id == t.token_to_id("<|endoftext|>")
    ids = hf.encode("hello world", eos=True)
    assert ids[-1] == hf.eos_id and hf.decode(ids) == "hello world"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path / "nope")
