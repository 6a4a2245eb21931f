from poise.engine.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE = "naïve café 東京 — ünïcödé 🎉 done"


def test_incremental_decoding_never_emits_half_a_character(llama_dir):
    tok = Tokenizer(llama_dir)
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE) // 2  # byte-level pieces split the characters
    d = IncrementalDetokenizer(tok, tok.encode("Prompt:"), stop=[])
    deltas = []
    for t in ids:
        d.add_token(t)
        deltas.append(d.take_delta(final=False))
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == MULTIBYTE == tok.decode(ids)


def test_stop_string_is_held_back_then_cut(llama_dir):
    tok = Tokenizer(llama_dir)
    ids = tok.encode("alpha beta STOP gamma", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    streamed = ""
    for t in ids:
        d.add_token(t)
        streamed += d.take_delta(final=False)
        assert "ST" not in streamed or "STOP" in streamed  # never part of the stop string
        if d.stopped_by:
            break
    streamed += d.take_delta(final=True)
    assert d.stopped_by == "STOP"
    assert streamed == d.text == "alpha beta "


def test_include_stop_string(llama_dir):
    tok = Tokenizer(llama_dir)
    d = IncrementalDetokenizer(tok, [], stop=["beta"], include_stop_str_in_output=True)
    for t in tok.encode("alpha beta gamma", add_special_tokens=False):
        d.add_token(t)
    assert d.text == "alpha beta"


def test_chat_template_and_special_tokens(llama_dir):
    tok = Tokenizer(llama_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.encode("x")[0]  # bos is a single special token, added by encode too
    assert len(tok.eos_token_ids) == 2  # end_of_text and im_end
