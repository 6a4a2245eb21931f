"""A GGUF's tokenizer metadata → a ``tokenizers`` Tokenizer and the tokenizer/generation config.

A GGUF carries no tokenizer.json. llama.cpp's converter stores the vocabulary, the merges (or,
for SentencePiece vocabularies, the piece scores), a type per token and only the *name* of the
pre-tokenizer (``tokenizer.ggml.pre``); the regexes behind each name live in llama.cpp's C++.
We rebuild the Hugging Face form from that metadata and follow llama.cpp wherever the metadata
leaves a choice open, because llama.cpp's behaviour is what a GGUF's users know:

- ``gpt2`` (byte-level BPE): vocabulary and merges as stored, the pre-tokenizer named by
  ``tokenizer.ggml.pre`` written as the original tokenizer.json spells it. A name we have no
  regex for is refused rather than guessed: a wrong split changes every id.
- ``llama`` (SentencePiece BPE): the merges are recovered from the scores (best score first),
  as Hugging Face's own SentencePiece converter does; whitespace is escaped to ``▁`` with a
  prefix space, characters outside the vocabulary fall back to ``<0xNN>`` byte tokens.
- Tokens of type CONTROL (and UNKNOWN) become special added tokens, USER_DEFINED ones plain
  added tokens, so both are matched whole in the text as llama.cpp does.
- BOS/EOS are added when ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say so, with
  llama.cpp's defaults where the key is missing.
- End-of-generation ids: the eos/eot/eom ids the metadata names, plus the tokens llama.cpp
  treats as end-of-generation by their text (``<|im_end|>``, ``<|eot_id|>``, ...), since a
  GGUF has no generation_config.json and llama.cpp stops on those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gguf import Keys, TokenType
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from poise.engine.errors import ModelLoadError

_TOK = Keys.Tokenizer
_SPIECE_SPACE = "\u2581"

# The pre-tokenizer regexes, as the original models' tokenizer.json files write them (llama.cpp
# carries hand-adapted copies of the same in llama-vocab.cpp).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback for a file without a pre-tokenizer name: four regexes applied in turn.
_DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# Text of the tokens llama.cpp ends generation on whatever their type (llama-vocab.cpp).
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)


@dataclass(frozen=True, slots=True)
class _PreTokenizer:
    build: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False  # a word that is itself a token is taken whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file does not say


def _split_then_bytes(*regexes: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )

    return build


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _pre_tokenizers() -> dict[str, _PreTokenizer]:
    table: dict[str, _PreTokenizer] = {
        "default": _PreTokenizer(_split_then_bytes(*_DEFAULT_REGEXES))
    }
    groups: list[tuple[tuple[str, ...], _PreTokenizer]] = [
        (("gpt-2", "phi-2", "mpt", "olmo"), _PreTokenizer(_gpt2)),
        (
            ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
            _PreTokenizer(_split_then_bytes(_LLAMA3_REGEX), ignore_merges=True, add_bos=True),
        ),
        (("dbrx", "smaug-bpe"), _PreTokenizer(_split_then_bytes(_LLAMA3_REGEX))),
        (
            ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"),
            _PreTokenizer(_split_then_bytes(_QWEN2_REGEX)),
        ),
        (
            ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
            _PreTokenizer(_digits_then_gpt2),
        ),
        (
            ("tekken",),
            _PreTokenizer(_split_then_bytes(_TEKKEN_REGEX), ignore_merges=True, add_bos=True),
        ),
        (("gpt-4o", "llama4"), _PreTokenizer(_split_then_bytes(_GPT4O_REGEX))),
    ]
    for names, spec in groups:
        table.update(dict.fromkeys(names, spec))
    return table


PRE_TOKENIZERS = _pre_tokenizers()


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


def tokenizer_from_metadata(meta: Mapping[str, Any]) -> GGUFTokenizer:
    """The tokenizer a GGUF's ``tokenizer.*`` metadata describes (``meta``: key → value)."""
    tokens: list[str] | None = meta.get(_TOK.LIST)
    if not tokens:
        raise ModelLoadError(f"the GGUF has no {_TOK.LIST} (no vocabulary)")
    kind = meta.get(_TOK.MODEL)
    types = list(meta.get(_TOK.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"{_TOK.TOKEN_TYPE} has {len(types)} entries for {len(tokens)} tokens")
    if kind == "gpt2":
        spec = _named_pre_tokenizer(meta)
        tok = _byte_level_bpe(meta, tokens, spec)
        add_bos_default = spec.add_bos
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens, types)
        add_bos_default = True
    else:
        raise ModelLoadError(
            f"tokenizer model {kind!r} ({_TOK.MODEL}) is not supported; poise reads 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece BPE)"
        )
    _add_special_tokens(tok, tokens, types, rstrip=_phi3_rstrip(meta))
    add_bos = bool(meta.get(_TOK.ADD_BOS, add_bos_default))
    add_eos = bool(meta.get(_TOK.ADD_EOS, False))
    ids = _special_ids(meta, len(tokens))
    _add_template(tok, tokens, ids, add_bos, add_eos)
    config: dict[str, Any] = {
        f"{name}_token": tokens[ids[name]]
        for name in ("bos", "eos", "unk", "pad")
        if ids.get(name) is not None
    }
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    if (template := _chat_template(meta)) is not None:
        config["chat_template"] = template
    return GGUFTokenizer(tok, config, _generation_config(tokens, ids))


def _named_pre_tokenizer(meta: Mapping[str, Any]) -> _PreTokenizer:
    # llama.cpp treats a file without the key (written before May 2024) as "default".
    name = meta.get(_TOK.PRE) or "default"
    if name not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"pre-tokenizer {name!r} ({_TOK.PRE}) is not known to poise; it reads "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], spec: _PreTokenizer) -> Tokenizer:
    raw_merges = meta.get(_TOK.MERGES)
    if not raw_merges:
        raise ModelLoadError(f"a byte-level BPE GGUF needs {_TOK.MERGES}, and this one has none")
    merges = [_merge_pair(m) for m in raw_merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges)
    except Exception as exc:  # tokenizers raises plain Exception for inconsistent merges
        raise ModelLoadError(f"the GGUF's merges do not fit its vocabulary: {exc}") from exc
    tok = Tokenizer(model)
    tok.pre_tokenizer = spec.build()
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge_pair(merge: str) -> tuple[str, str]:
    # As llama.cpp splits: at the first space after the first character.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ModelLoadError(f"merge {merge!r} in {_TOK.MERGES} is not 'left right'")
    return merge[:cut], merge[cut + 1 :]


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = meta.get(_TOK.SCORES)
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"a SentencePiece GGUF needs one {_TOK.SCORES} entry per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get(_TOK.UNK_ID)
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == TokenType.UNKNOWN), None)
    byte_fallback = "<0x00>" in vocab
    model = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, scores, types, vocab),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=byte_fallback,
    )
    tok = Tokenizer(model)
    space_prefix = bool(meta.get(_TOK.ADD_PREFIX, True))
    escape = normalizers.Replace(" ", _SPIECE_SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPIECE_SPACE), escape])
        if space_prefix
        else escape
    )
    steps: list[decoders.Decoder] = [decoders.Replace(_SPIECE_SPACE, " ")]
    if byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the pair whose joined piece scores best; as BPE merges that is
    every split of every piece into two pieces, ranked by the joined piece's score (ties: the
    piece, then its halves, in vocabulary order, as Hugging Face's converter orders them)."""
    mergeable = (TokenType.NORMAL, TokenType.USER_DEFINED)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for tid, piece in enumerate(tokens):
        if types[tid] not in mergeable:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if (lid := vocab.get(left)) is not None and (rid := vocab.get(right)) is not None:
                ranked.append((-scores[tid], tid, lid, rid, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _phi3_rstrip(meta: Mapping[str, Any]) -> Callable[[str], bool]:
    # llama.cpp makes Phi-3's special tokens swallow the whitespace after them, keyed on the
    # model's name (the original tokenizer.json's rstrip flags are not in the GGUF).
    name = str(meta.get(Keys.General.NAME) or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return lambda _token: False
    return lambda token: token not in ("<unk>", "<s>", "<|endoftext|>")


def _add_special_tokens(
    tok: Tokenizer, tokens: list[str], types: list[int], rstrip: Callable[[str], bool]
) -> None:
    special: list[AddedToken] = []
    user: list[AddedToken] = []
    for token, kind in zip(tokens, types, strict=True):
        if not token:
            continue
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            special.append(AddedToken(token, normalized=False, special=True, rstrip=rstrip(token)))
        elif kind == TokenType.USER_DEFINED:
            user.append(AddedToken(token, normalized=False, special=False, rstrip=rstrip(token)))
    tok.add_special_tokens(special)
    tok.add_tokens(user)


def _special_ids(meta: Mapping[str, Any], n_tokens: int) -> dict[str, int]:
    keys = {
        "bos": _TOK.BOS_ID,
        "eos": _TOK.EOS_ID,
        "unk": _TOK.UNK_ID,
        "pad": _TOK.PAD_ID,
        "eot": _TOK.EOT_ID,
        "eom": _TOK.EOM_ID,
    }
    ids: dict[str, int] = {}
    for name, key in keys.items():
        value = meta.get(key)
        if value is None:
            continue
        if not 0 <= int(value) < n_tokens:
            raise ModelLoadError(f"{key} = {value} is outside the vocabulary of {n_tokens}")
        ids[name] = int(value)
    return ids


def _add_template(
    tok: Tokenizer, tokens: list[str], ids: dict[str, int], add_bos: bool, add_eos: bool
) -> None:
    for name, wanted in (("bos", add_bos), ("eos", add_eos)):
        if wanted and name not in ids:
            raise ModelLoadError(f"the GGUF asks to add a {name.upper()} token but names none")
    if not (add_bos or add_eos):
        return
    bos = tokens[ids["bos"]] if add_bos else None
    eos = tokens[ids["eos"]] if add_eos else None

    def sequence(name: str, type_id: int) -> list[str]:
        # "token:type" pieces, so a token holding a colon is still read whole.
        return [f"{t}:{type_id}" for t in (bos, f"${name}", eos) if t is not None]

    tok.post_processor = processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=sequence("A", 0) + sequence("B", 1),
        special_tokens=[(tokens[ids[n]], ids[n]) for n, on in (("bos", bos), ("eos", eos)) if on],
    )


def _chat_template(meta: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    default = meta.get(_TOK.CHAT_TEMPLATE)
    prefix = _TOK.CHAT_TEMPLATE + "."
    named = [
        {"name": key[len(prefix) :], "template": value}
        for key, value in meta.items()
        if key.startswith(prefix)
    ]
    if not named:
        return default
    return ([{"name": "default", "template": default}] if default is not None else []) + named


def _generation_config(tokens: list[str], ids: dict[str, int]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if "bos" in ids:
        config["bos_token_id"] = ids["bos"]
    stops = [ids[name] for name in ("eos", "eot", "eom") if name in ids]
    stops += [i for i, t in enumerate(tokens) if t in _END_OF_GENERATION_TEXTS]
    if stops:
        config["eos_token_id"] = list(dict.fromkeys(stops))
    return config
