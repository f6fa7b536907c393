"""HF checkpoints: load Llama/Qwen2 folders (single file and sharded) with the real loader and
compare logits with `transformers`; our save loads back in both; tokenizer.json files."""

import dataclasses
import json

import pytest
import torch

from policy import (
    CharTokenizer,
    ModelConfig,
    SamplingConfig,
    Transformer,
    generate,
    hf_name_map,
    load_hf_checkpoint,
    load_hf_tokenizer,
    load_tokenizer,
    save_hf_checkpoint,
)
from policy.tokenizer import HFTokenizer
from tests.helpers.bpe import chat_tokenizer_folder
from tests.helpers.tolerance import transformers_tol

transformers = pytest.importorskip("transformers")


def hf_model(kind: str, tie=False):
    torch.manual_seed(0)
    common = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    if kind == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():  # HF inits biases to 0: make them matter
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return m.eval()


@pytest.mark.parametrize(
    "kind,tie,shard", [("qwen2", False, None), ("qwen2", True, "60KB"), ("llama", False, "60KB")]
)
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
        want = ref(idx).logits.float()
        # why: transformers runs the same math in its own kernels and order, its RoPE angles in fp32
        torch.testing.assert_close(ours(idx), want, **transformers_tol(cfg, want, idx.shape[1]))


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
        want = ours(idx)
        # why: transformers runs the same math in its own kernels and order, its RoPE angles in fp32
        torch.testing.assert_close(ref(idx).logits.float(), want, **transformers_tol(cfg, want, idx.shape[1]))
        # why equal: the same fp32 bits saved and loaded, the same code, shapes and threads
        assert torch.equal(back(idx), want)
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
    t.train_from_iterator(
        ["hello world", "12+7=19", "def f(x): return x"] * 50,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]),
    )
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf = load_hf_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer) and hf.eos_id == t.token_to_id("<|endoftext|>")
    ids = hf.encode("hello world", eos=True)
    assert ids[-1] == hf.eos_id and hf.decode(ids) == "hello world"
    # the tokenizer.json's own path (as `asyncrl tasks predict --model` passes it): the same tokenizer
    by_file = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert by_file.eos_id == hf.eos_id and by_file.encode("hello world") == hf.encode("hello world")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path / "nope")


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def scaled_llama(scaling: dict, tie: bool):
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=0.2,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "scaling,tie", [(LLAMA3_SCALING, True), ({"rope_type": "linear", "factor": 4.0}, False)]
)
def test_rope_scaling_matches_transformers(tmp_path, scaling, tie):
    ref = scaled_llama(scaling, tie)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    cfg, ours = load_hf_checkpoint(tmp_path)
    assert cfg.rope_scaling == scaling and cfg.rope_theta == 500000.0 and cfg.tie_embeddings == tie
    assert (ours.lm_head is None) == tie
    # positions far past original_max_position_embeddings, where the scaling changes the rotation
    idx = torch.randint(0, 97, (2, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(idx).logits.float()
        # why: transformers runs the same math in its own kernels and order, its RoPE angles in fp32
        torch.testing.assert_close(ours(idx), want, **transformers_tol(cfg, want, idx.shape[1]))
        plain = Transformer(dataclasses.replace(cfg, rope_scaling=None)).eval()
        plain.load_state_dict(ours.state_dict(), strict=False)
        plain.reset_rope()
        assert (plain(idx) - want).abs().max() > 1e-2  # the scaling is what makes them agree
        # the KV-cached path uses the same tables: greedy decoding agrees with transformers'
        prompt = idx[0, :20].tolist()
        out = generate(ours, [prompt], SamplingConfig(0.0), 12)[0].ids
        hf_out = ref.generate(
            idx[:1, :20], max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0
        )[0, 20:].tolist()
        assert out == hf_out
    # our save writes the scaling back; transformers and we load it to the same logits
    save_hf_checkpoint(ours, tmp_path / "again")
    cfg2, back = load_hf_checkpoint(tmp_path / "again")
    assert cfg2 == cfg
    ref2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        tol = transformers_tol(cfg, want, idx.shape[1])  # why: as above
        torch.testing.assert_close(ref2(idx).logits.float(), want, **tol)


def test_real_checkpoint_config_features_and_refusals(tmp_path):
    from policy.hf import config_from_hf

    base = {
        "model_type": "llama",
        "vocab_size": 50,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 8192,
    }
    # transformers < 5 spelling of the same scaling
    old = config_from_hf(
        {**base, "rope_theta": 5e5, "rope_scaling": {**LLAMA3_SCALING, "rope_type": None, "type": "llama3"}}
    )
    assert old.rope_scaling == LLAMA3_SCALING and old.rope_theta == 5e5
    assert config_from_hf({**base, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    # Mistral's sliding window is exact full attention up to the window: the length is capped there
    assert config_from_hf({**base, "model_type": "mistral", "sliding_window": 4096}).max_seq_len == 4096
    assert (
        config_from_hf(
            {**base, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
        ).max_seq_len
        == 8192
    )
    for bad, match in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
    ]:
        with pytest.raises(ValueError, match=match):
            config_from_hf({**base, **bad})
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        ModelConfig.tiny(rope_scaling={**LLAMA3_SCALING, "high_freq_factor": 0.5})
    with pytest.raises(ValueError, match="unknown keys"):
        ModelConfig.tiny(rope_scaling={"rope_type": "linear", "factor": 2.0, "extra": 1})
    # the config travels as a dict (wire / TOML) with its scaling
    c = ModelConfig.tiny(rope_scaling=dict(LLAMA3_SCALING))
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_chat_template_through_the_tokenizer_matches_transformers(tmp_path):
    t = chat_tokenizer_folder(tmp_path)
    ours = load_hf_tokenizer(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    chats = [
        [{"role": "user", "content": "hello world"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "return x"},
            {"role": "user", "content": "again"},
        ],
    ]
    for msgs in chats:
        for gen in (True, False):
            text = ours.render_chat(msgs, add_generation_prompt=gen)
            assert text == ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            ids = ours.apply_chat_template(msgs, add_generation_prompt=gen)
            want = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
            assert ids == (want["input_ids"] if not isinstance(want, list) else want)
            # chat markup is one special id each, not spelled out in bytes
            assert ids.count(t.token_to_id("<|im_start|>")) == len(msgs) + gen
    assert ours.eos_id == t.token_to_id("<|im_end|>") and ours.special_tokens["eos_token"] == "<|im_end|>"
    # transformers >= 4.43 may keep the template in chat_template.jinja: that one wins
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert load_hf_tokenizer(tmp_path).render_chat(chats[0]) == "<|im_start|>hello world"


def test_chat_template_bad_inputs(tmp_path):
    chat_tokenizer_folder(tmp_path, template=None)
    with pytest.raises(ValueError, match="no chat template"):
        load_hf_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    chat_tokenizer_folder(tmp_path, template="{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="does not parse"):
        load_hf_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])
    chat_tokenizer_folder(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="list of"):
        tok.render_chat([{"content": "no role"}])
    with pytest.raises(ValueError, match="list of"):
        tok.render_chat("hello")
    # templates ship with checkpoints: they run sandboxed, and may refuse a conversation
    import jinja2

    chat_tokenizer_folder(tmp_path, template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        load_hf_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])
    chat_tokenizer_folder(tmp_path, template="{{ raise_exception('only user turns') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="only user turns"):
        load_hf_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])
