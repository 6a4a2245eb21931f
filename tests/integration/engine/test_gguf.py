"""GGUF files read back as the Hugging Face checkpoints they were converted from.

Tiny checkpoints of each architecture are written here (make_model, or transformers for qwen3,
phi3 and a llama with biases), converted by tests/ggufwriter.py as llama.cpp's converter does,
and read with poise's GGUF reader: config, every weight and the tokenizer must come back as the
originals.
"""

import json
import random
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from ggufwriter import write_gguf
from poise.engine.errors import ModelLoadError
from poise.engine.models.gguf_container import read_header
from poise.engine.models.gguf_file import find_gguf, iter_gguf_weights, read_gguf
from poise.engine.models.gguf_tokenizer import tokenizer_from_metadata
from poise.modelgen.corpus import tokenizer_corpus
from poise.modelgen.make_model import make_model
from testconfigs import LLAMA3_SCALING

ARCHS = ("llama", "llama_bias", "qwen2", "qwen3", "phi3")
TEXTS = [
    "Hello world",
    "  leading spaces, trailing ones  ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "digits 1234567890, 3.14159 and 42nd",
    "unicode: héllo wörld — 你好，世界 🦙🚀 naïve café",
    "I'VE been 'told' he's there; we'll SEE what's what",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|>already has a bos",
    "mixed<|im_end|>special<|im_start|>tokens",
    "def f(x):\n    return x ** 2  # comment",
    "",
    " ",
    "\n\n\n",
    "a" * 40 + " " + "=" * 12,
]


def _transformers_model(out: Path, config, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    from transformers import LlamaConfig, Phi3Config, Qwen3Config

    root = tmp_path_factory.mktemp("gguf-hf")
    qwen2 = make_model(root / "qwen2", "qwen2", "tiny")
    shape = {
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
    }
    return {
        "llama": make_model(root / "llama", "llama", "tiny", rope_scaling=LLAMA3_SCALING),
        "qwen2": qwen2,
        # q/k biases through the rotary permutation, head_dim apart from hidden / heads
        "llama_bias": _transformers_model(
            root / "llama_bias",
            LlamaConfig(**shape, num_key_value_heads=1, head_dim=32, attention_bias=True),
            qwen2,
        ),
        "qwen3": _transformers_model(
            root / "qwen3",
            Qwen3Config(**shape, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
            qwen2,
        ),
        "phi3": _transformers_model(
            root / "phi3",
            Phi3Config(
                **shape,
                num_key_value_heads=2,
                max_position_embeddings=1024,
                original_max_position_embeddings=256,
                rope_scaling={
                    "type": "longrope",
                    "long_factor": [1.0 + i / 7 for i in range(8)],
                    "short_factor": [1.0 + i / 100 for i in range(8)],
                },
            ),
            qwen2,
        ),
    }


@pytest.fixture(scope="module")
def ggufs(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, tensor_type: str = "F32") -> Path:
        if (arch, tensor_type) not in cache:
            out = root / f"{arch}-{tensor_type}.gguf"
            # a neutral name: llama.cpp keys Phi-3 tokenizer quirks on general.name
            cache[arch, tensor_type] = write_gguf(hf_dirs[arch], out, tensor_type, name="tiny")
        return cache[arch, tensor_type]

    return get


def _original_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_config_carries_the_original_shape(arch, hf_dirs, ggufs):
    original = json.loads((hf_dirs[arch] / "config.json").read_text())
    config = read_gguf(ggufs(arch)).config
    rope = original.get("rope_parameters") or {}
    heads = original["num_attention_heads"]
    assert config["architectures"] == original["architectures"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == original[key], key
    assert config["rope_theta"] == rope.get("rope_theta", original.get("rope_theta"))
    expected_head_dim = original.get("head_dim") or original["hidden_size"] // heads
    assert config.get("head_dim", config["hidden_size"] // heads) == expected_head_dim
    if arch in ("llama_bias", "qwen3"):
        assert config["attention_bias"] == original["attention_bias"]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_weights_are_the_originals_exactly(arch, hf_dirs, ggufs):
    original = _original_weights(hf_dirs[arch])
    weights = dict(iter_gguf_weights(ggufs(arch), torch.float32))
    assert weights.keys() == original.keys()
    for name, tensor in original.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_weights_are_close(arch, hf_dirs, ggufs):
    original = _original_weights(hf_dirs[arch])
    weights = dict(iter_gguf_weights(ggufs(arch, "Q8_0"), torch.bfloat16))
    assert weights.keys() == original.keys()
    for name, tensor in original.items():
        got = weights[name].float()
        if tensor.dim() == 1:  # kept in F32 by the converter; only bfloat16 rounds them
            assert torch.allclose(got, tensor, rtol=1 / 128, atol=0), name
            continue
        # Q8_0: 32-value blocks at 1/127 of the block's largest value, then bfloat16.
        bound = tensor.abs().max() / 127 + tensor.abs().max() / 128
        assert (got - tensor).abs().max() <= bound, name
        assert got.shape == tensor.shape


@pytest.mark.parametrize(("tensor_type", "relative_error"), [("F16", 0.0), ("Q4_0", 1 / 7)])
def test_other_tensor_types(tensor_type, relative_error, hf_dirs, ggufs):
    original = _original_weights(hf_dirs["llama"])
    for name, got in iter_gguf_weights(ggufs("llama", tensor_type), torch.float32):
        ref = original[name]
        if tensor_type == "F16" and ref.dim() > 1:
            assert torch.equal(got, ref.half().float()), name
        else:
            assert (got - ref).abs().max() <= relative_error * ref.abs().max(), name


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_tokenizer_is_the_original(arch, hf_dirs, ggufs):
    original = Tokenizer.from_file(str(hf_dirs[arch] / "tokenizer.json"))
    tok = read_gguf(ggufs(arch)).tokenizer
    for text in TEXTS:
        for special in (True, False):
            ids = original.encode(text, add_special_tokens=special).ids
            assert tok.encode(text, add_special_tokens=special).ids == ids, (text, special)
            for skip in (True, False):
                expected = original.decode(ids, skip_special_tokens=skip)
                assert tok.decode(ids, skip_special_tokens=skip) == expected, (text, skip)


def test_chat_template_and_special_tokens(hf_dirs, ggufs):
    tokenizer_config = json.loads((hf_dirs["llama"] / "tokenizer_config.json").read_text())
    generation = json.loads((hf_dirs["llama"] / "generation_config.json").read_text())
    checkpoint = read_gguf(ggufs("llama"))
    config = checkpoint.tokenizer_config
    assert config["chat_template"] == tokenizer_config["chat_template"]
    for key in ("bos_token", "eos_token", "pad_token"):
        assert config[key] == tokenizer_config[key]
    assert config["add_bos_token"] is True
    assert config["add_eos_token"] is False
    assert checkpoint.generation_config == generation


def test_named_chat_templates(hf_dirs, tmp_path):
    model = tmp_path / "named"
    shutil.copytree(hf_dirs["qwen2"], model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    named = [
        {"name": "default", "template": config["chat_template"]},
        {"name": "tool_use", "template": "{{ tools }}"},
    ]
    config_path.write_text(json.dumps({**config, "chat_template": named}))
    checkpoint = read_gguf(write_gguf(model, tmp_path / "named.gguf"))
    assert checkpoint.tokenizer_config["chat_template"] == named


def test_llama3_rope_becomes_frequency_factors(hf_dirs, ggufs):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = read_gguf(ggufs("llama")).config["rope_scaling"]
    assert scaling["rope_type"] == "gguf_freq_factors"
    factors = torch.tensor(scaling["freq_factors"], dtype=torch.float64)
    config = LlamaConfig(**json.loads((hf_dirs["llama"] / "config.json").read_text()))
    head_dim = config.head_dim
    plain = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    # What llama.cpp computes (plain / factors) is what transformers' llama3 rope computes.
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    torch.testing.assert_close(plain / factors, inv_freq.double(), rtol=1e-6, atol=0)


def test_phi3_longrope_comes_back(hf_dirs, ggufs):
    original = json.loads((hf_dirs["phi3"] / "config.json").read_text())
    rope = original["rope_parameters"]
    config = read_gguf(ggufs("phi3")).config
    scaling = config["rope_scaling"]
    assert scaling["type"] == scaling["rope_type"] == "longrope"
    assert scaling["long_factor"] == pytest.approx(rope["long_factor"], rel=1e-7)
    assert scaling["short_factor"] == pytest.approx(rope["short_factor"], rel=1e-7)
    assert scaling["original_max_position_embeddings"] == 256
    assert config["original_max_position_embeddings"] == 256
    assert config["sliding_window"] is None


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
)
def test_rope_scaling_comes_back(scaling, hf_dirs, tmp_path):
    model = tmp_path / "scaled"
    shutil.copytree(hf_dirs["qwen2"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    assert read_gguf(write_gguf(model, tmp_path / "m.gguf")).config["rope_scaling"] == scaling


def test_header_reads_as_gguf_reader_does(ggufs):
    path = ggufs("qwen3", "Q8_0")
    meta, tensors = read_header(path)
    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == expected
    assert [t.name for t in reader.tensors] == list(tensors)
    for t in reader.tensors:
        info = tensors[t.name]
        assert (info.qtype, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert info.shape == tuple(reversed(t.shape.tolist()))


# --- pre-tokenizers -----------------------------------------------------------------------------


def _split_then_bytes(regex: str) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    }


def _original_pre_tokenizer(pre: str) -> tuple[dict, bool]:
    """How the original tokenizer.json of a model with this llama.cpp name spells its
    pre-tokenizer (regexes from transformers), and whether its BPE ignores merges."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    if pre == "llama-bpe":
        return _split_then_bytes(TikTokenConverter().pattern), True
    if pre == "qwen2":
        return _split_then_bytes(PRETOKENIZE_REGEX), False
    assert pre == "smollm"
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    }, False


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm"])
def test_named_pre_tokenizers_split_as_the_originals(pre, hf_dirs, tmp_path):
    spec = json.loads((hf_dirs["llama"] / "tokenizer.json").read_text())
    spec["pre_tokenizer"], spec["model"]["ignore_merges"] = _original_pre_tokenizer(pre)
    original = Tokenizer.from_str(json.dumps(spec))
    tok = read_gguf(write_gguf(hf_dirs["llama"], tmp_path / "m.gguf", pre=pre)).tokenizer
    for text in TEXTS:
        ids = original.encode(text).ids
        assert tok.encode(text).ids == ids, text
        assert tok.decode(ids) == original.decode(ids)


def test_default_pre_tokenizer_round_trips(hf_dirs, tmp_path):
    tok = read_gguf(write_gguf(hf_dirs["llama"], tmp_path / "m.gguf", pre="default")).tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    # llama.cpp's default splits digit runs into threes
    pieces = tok.pre_tokenizer.pre_tokenize_str("1234567")
    assert [p for p, _ in pieces] == ["123", "456", "7"]


def test_phi3_named_models_strip_after_special_tokens(ggufs):
    meta, _ = read_header(ggufs("phi3"))
    assert meta["general.name"] == "tiny"
    plain = tokenizer_from_metadata(meta).tokenizer
    phi3 = tokenizer_from_metadata({**meta, "general.name": "Phi-3-mini"}).tokenizer
    text = "<|im_start|>\nhello"
    assert phi3.encode(text).ids == plain.encode("<|im_start|>hello").ids
    assert plain.encode(text).ids != phi3.encode(text).ids


# --- SentencePiece vocabularies -----------------------------------------------------------------

SPIECE = "\u2581"


@pytest.fixture(scope="module")
def spm_metadata() -> dict:
    """A SentencePiece-style GGUF vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces
    whose scores fall in the order they were learned."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPIECE), normalizers.Replace(" ", SPIECE)]
    )
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trained.train_from_iterator(
        tokenizer_corpus(600, 0), trainers.BpeTrainer(vocab_size=600, show_progress=False)
    )
    pieces = sorted(trained.get_vocab(), key=trained.token_to_id)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def _llama_cpp_spm(meta: dict, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenization: special tokens cut out, a space before every
    other fragment, then the best-scoring adjacent pair merged until none is a piece, and
    characters outside the vocabulary spelled as byte tokens."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in enumerate(tokens)}
    pieces = {t: scores[i] for i, t in enumerate(tokens) if types[i] == 1}
    out = [1]
    fragments = [f for f in re.split(r"(<s>|</s>)", text) if f]
    for fragment in fragments:
        if fragment in ("<s>", "</s>"):
            out.append(ids[fragment])
            continue
        symbols = list((" " + fragment).replace(" ", SPIECE))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                joined = symbols[i] + symbols[i + 1]
                if joined in pieces and (best is None or pieces[joined] > best[0]):
                    best = (pieces[joined], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for symbol in symbols:
            if symbol in pieces:
                out.append(ids[symbol])
            else:
                out.extend(ids[f"<0x{b:02X}>"] for b in symbol.encode())
    return out


def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(spm_metadata):
    result = tokenizer_from_metadata(spm_metadata)
    tok = result.tokenizer
    texts = [t for t in TEXTS if "<|" not in t] + ["<s>after a bos", "in</s>the middle"]
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == _llama_cpp_spm(spm_metadata, text), text
        if "<s>" not in text and "</s>" not in text:
            assert tok.decode(ids) == text
    assert result.tokenizer_config["bos_token"] == "<s>"
    assert result.tokenizer_config["add_bos_token"] is True
    assert result.generation_config == {"bos_token_id": 1, "eos_token_id": [2]}


def test_sentencepiece_merges_follow_scores_on_random_vocabularies():
    """Tiny vocabularies of overlapping pieces of 'a', 'b' and '▁' make the merge order (and
    ties between splits of one piece) matter; the recovered merges must still agree with
    llama.cpp's best-score-first pairing."""
    rng = random.Random(0)
    for _ in range(40):
        pieces = {SPIECE, "a", "b"}
        while len(pieces) < 12:
            pieces.add("".join(rng.choice([SPIECE, "a", "b"]) for _ in range(rng.randint(2, 4))))
        ordered = sorted(pieces)
        rng.shuffle(ordered)
        meta = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"]
            + [f"<0x{b:02X}>" for b in range(256)]
            + ordered,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(ordered))],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(ordered),
            "tokenizer.ggml.bos_token_id": 1,
        }
        tok = tokenizer_from_metadata(meta).tokenizer
        for _ in range(25):
            text = "".join(rng.choice("ab ") for _ in range(rng.randint(1, 12)))
            assert tok.encode(text).ids == _llama_cpp_spm(meta, text), (ordered, text)


# --- what is refused ----------------------------------------------------------------------------


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray], **kv) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    for key, value in kv.items():
        writer.add_string(key, value)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(tmp_path / "junk.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        read_gguf(tmp_path / "empty.gguf")


def test_unknown_architecture_is_refused(tmp_path):
    path = _write(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ModelLoadError, match="'mamba'"):
        read_gguf(path)


def test_unknown_pre_tokenizer_is_refused(hf_dirs, tmp_path):
    path = write_gguf(hf_dirs["qwen2"], tmp_path / "m.gguf", pre="no-such-pre")
    with pytest.raises(ModelLoadError, match="'no-such-pre'"):
        read_gguf(path)


def test_undequantizable_tensor_type_is_refused(tmp_path):
    path = _write(tmp_path / "m.gguf", "llama", {"token_embd.weight": np.zeros((4, 8), np.int8)})
    with pytest.raises(ModelLoadError, match="I8"):
        read_gguf(path)


def test_unknown_tensor_and_missing_key_are_named(hf_dirs, tmp_path):
    embed = {"token_embd.weight": np.zeros((4, 8), np.float32)}
    path = _write(
        tmp_path / "a.gguf", "llama", {**embed, "blk.0.mystery.weight": embed["token_embd.weight"]}
    )
    with pytest.raises(ModelLoadError, match=r"blk\.0\.mystery\.weight"):
        read_gguf(path)
    with pytest.raises(ModelLoadError, match=r"llama\.embedding_length"):
        read_gguf(_write(tmp_path / "b.gguf", "llama", embed))


def test_find_gguf(hf_dirs, ggufs, tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(ggufs("llama"), single / "model.gguf")
    assert find_gguf(single) == single / "model.gguf"
    assert find_gguf(single / "model.gguf") == single / "model.gguf"
    assert find_gguf(hf_dirs["llama"]) is None
    assert find_gguf(hf_dirs["llama"] / "config.json") is None
    assert find_gguf(tmp_path / "missing") is None
    both = tmp_path / "both"  # a Hugging Face directory that also holds a GGUF stays one
    shutil.copytree(single, both)
    shutil.copy(hf_dirs["llama"] / "config.json", both / "config.json")
    assert find_gguf(both) is None
    shutil.copy(ggufs("llama"), single / "other.gguf")
    with pytest.raises(ModelLoadError, match=r"model\.gguf.*other\.gguf|other\.gguf.*model\.gguf"):
        find_gguf(single)
