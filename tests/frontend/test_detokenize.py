"""Streaming detokenisation and stop detection, held against ``tokenizer.decode``.

Two tokenizers are built here without the network: a byte-level BPE (GPT-2 /
Llama-3 / Qwen style) and a sentencepiece-style BPE with Metaspace and
byte-fallback ``<0x..>`` pieces (Llama-2 / Mistral style)."""

from __future__ import annotations

import json
import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from stagewise.frontend.detokenize import IncrementalDetokenizer, StopChecker  # noqa: E402

CORPUS = [
    "Hello world! Café crème brûlée, naïve façade.",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji time 😀🎉👍🏽 and 🇫🇷 flags, ok?",
    "Straße, Ærø, Ελληνικά, русский текст.",
    "The quick brown fox jumps over the lazy dog. STOP here.",
] * 20

TEXTS = [
    "Hello café 😀 日本語 ✓ zebra",
    "  two leading spaces and trailing  ",
    "👍🏽🇫🇷 emoji sequences, ZWJ: 👩‍💻, rare: 𝄞 ⌘ ∑",
    "Ελληνικά русский 中文 한국어 mixed with ASCII.",
    "\n\nnewlines\tand tabs\n",
]


def byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def byte_fallback_tokenizer() -> Tokenizer:
    """Metaspace BPE whose vocab holds all 256 ``<0xHH>`` pieces as ordinary tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    base = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # A small alphabet leaves many characters (some of 'H', most CJK) to the byte pieces.
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, limit_alphabet=60, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    trained = json.loads(base.to_str())["model"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in specials]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    tok.add_special_tokens(specials)
    return tok


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tokenizer(request) -> Tokenizer:
    return byte_level_tokenizer() if request.param == "byte_level" else byte_fallback_tokenizer()


def stream(tok, ids, prompt=None, skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


def check_stream(tok, ids, prompt=(), skip=True) -> bool:
    """Asserts the streaming contract; returns False when the case is undefined (see below)."""
    full = tok.decode(list(prompt) + list(ids), skip_special_tokens=skip)
    before = tok.decode(list(prompt), skip_special_tokens=skip)
    if not full.startswith(before):
        return False  # the prompt ends inside a character: no well-defined 'new text'
    pieces = stream(tok, ids, prompt=list(prompt) or None, skip=skip)
    expected = full[len(before):]
    assert "".join(pieces) == expected, (ids, pieces, expected)
    if "\ufffd" not in expected:
        assert not any("\ufffd" in p for p in pieces), (ids, pieces)
    return True


def test_fixtures_exercise_partial_characters(tokenizer):
    """The tokenizers really split characters across tokens (else the tests below prove little)."""
    ids = tokenizer.encode(TEXTS[0]).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_streams_to_its_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert check_stream(tokenizer, ids)
    pieces = stream(tokenizer, ids)
    # Text is released as soon as it is complete, not all at the end.
    assert sum(1 for p in pieces[:-1] if p) > len(ids) // 3


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_after_a_prompt(tokenizer, text):
    ids = tokenizer.encode(text).ids
    checked = sum(check_stream(tokenizer, ids[cut:], prompt=ids[:cut]) for cut in range(len(ids)))
    assert checked > len(ids) // 2


def test_random_token_sequences(tokenizer):
    """Arbitrary ids, invalid byte runs and special tokens included, with and without a prompt."""
    rng = random.Random(1234)
    vocab = tokenizer.get_vocab_size()
    checked = 0
    for trial in range(3000):
        n = rng.randint(0, 30)
        # A third of the cases draw from the low ids only: specials and (byte-fallback) byte pieces.
        high = 60 if trial % 3 == 0 else vocab
        ids = [rng.randrange(high) for _ in range(n)]
        cut = rng.randint(0, min(8, n)) if trial % 2 else 0
        checked += check_stream(tokenizer, ids[cut:], prompt=ids[:cut], skip=trial % 4 != 1)
    assert checked > 2500


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.token_to_id("<|eos|>") if tokenizer.token_to_id("<|eos|>") is not None else 2
    ids = tokenizer.encode("Café 😀").ids + [eos] + tokenizer.encode(" ok 日本").ids
    for skip in (True, False):
        assert check_stream(tokenizer, ids, skip=skip)
    kept = "".join(stream(tokenizer, ids, skip=False))
    assert tokenizer.id_to_token(eos) in kept


def test_byte_fallback_run_is_held_until_it_ends():
    tok = byte_fallback_tokenizer()
    euro = [tok.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in euro] == ["", "", ""]
    # Only the next ordinary token settles the run ("€" + "a"): a further byte could still
    # have turned it into three replacement characters.
    assert detok.push(tok.token_to_id("a")) == "€a"
    assert detok.flush() == ""


def test_prompt_ending_inside_a_long_byte_run():
    """The prompt's decode window must not start in the middle of a run of byte pieces."""
    tok = byte_fallback_tokenizer()
    as_bytes = lambda text: [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode()]  # noqa: E731
    prompt = tok.encode("Hi").ids + as_bytes("日本語")  # nine byte pieces
    ids = as_bytes("中") + [tok.token_to_id("a")]
    assert check_stream(tok, ids, prompt=prompt)
    assert "".join(stream(tok, ids, prompt=prompt)) == "中a"


def test_prompt_ending_in_special_tokens(tokenizer):
    """Output after skipped tokens keeps the space a sentencepiece decoder drops at the very start."""
    special = tokenizer.token_to_id("<s>") or tokenizer.token_to_id("<|pad|>")
    prompt = tokenizer.encode("Hello").ids + [special] * 8
    ids = tokenizer.encode("Hello world").ids[len(tokenizer.encode("Hello").ids):]
    assert check_stream(tokenizer, ids, prompt=prompt)
    assert "".join(stream(tokenizer, ids, prompt=prompt)).startswith(" ")


# ---------------------------------------------------------------- StopChecker


def run_stop(stop, pieces, final=""):
    checker = StopChecker(stop=stop)
    out = []
    for piece in pieces:
        text, reason = checker.feed(piece)
        out.append(text)
        if reason:
            return out, reason
    text, reason = checker.finish(final)
    out.append(text)
    return out, reason


def plain_stop(stop, text):
    """Independent reference: truncate before the stop string that ends first."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    return (text[: min(ends)[1]], "stop") if ends else (text, None)


@pytest.mark.parametrize(
    "stop,pieces",
    [
        (["STOP"], ["Hello ST", "O", "P and more"]),
        (["STOP"], ["S", "T", "O", "P"]),
        (["STOP"], ["Hello STO", "NE and STOP"]),
        (["\n\n", "###"], ["a\n", "\nb"]),
        (["日本"], ["中文 日", "本語"]),
        (["😀!"], ["x😀", "?😀", "! y"]),
        (["abc", "bcd"], ["xab", "cd"]),
        (["abcd", "c"], ["ab", "cd"]),
        (["never"], ["no stop ", "here, nev", "e"]),
    ],
)
def test_stop_strings_across_pieces(stop, pieces):
    out, reason = run_stop(stop, pieces)
    expected, expected_reason = plain_stop(stop, "".join(pieces))
    assert "".join(out) == expected and reason == expected_reason
    for i in range(len(out)):
        emitted = "".join(out[: i + 1])
        assert not any(s in emitted for s in stop)


def test_stop_tail_is_held_back_then_released():
    checker = StopChecker(stop=["STOP"])
    assert checker.feed("Hello ST") == ("Hello ", None)
    assert checker.feed("AR") == ("STAR", None)
    assert checker.feed("S") == ("", None)
    assert checker.finish() == ("S", None)


def test_stop_found_in_final_flush():
    assert run_stop(["END"], ["abc E"], final="ND tail") == (["abc ", ""], "stop")


def test_random_streams_match_plain_truncation():
    rng = random.Random(7)
    alphabet = "ab日😀 "
    for _ in range(2000):
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        out, reason = run_stop(stop, pieces)
        assert ("".join(out), reason) == plain_stop(stop, text), (stop, pieces)


def test_stop_and_eos_token_ids():
    checker = StopChecker(stop_token_ids=[5], eos_token_ids=[0, 7])
    assert [checker.is_stop_token(t) for t in (0, 5, 7, 3)] == [True, True, True, False]
    assert not StopChecker().is_stop_token(0)


def test_stream_with_tokenizer_eos_and_stop_string(tokenizer):
    """The engine loop: detokenise, check stop ids first, then stop strings."""
    eos = 2 if tokenizer.token_to_id("</s>") == 2 else tokenizer.token_to_id("<|eos|>")
    ids = tokenizer.encode("Café 😀 and STOP here").ids

    def drive(stop, stream_ids):
        detok, checker, out = IncrementalDetokenizer(tokenizer), StopChecker(stop=stop, eos_token_ids=[eos]), []
        for tok in stream_ids:
            if checker.is_stop_token(tok):
                text, _ = checker.finish(detok.flush())
                return "".join(out) + text, "stop"
            text, reason = checker.feed(detok.push(tok))
            out.append(text)
            if reason:
                return "".join(out), reason
        text, reason = checker.finish(detok.flush())
        return "".join(out) + text, reason or "length"

    full = tokenizer.decode(ids)
    assert drive(["STOP"], ids) == (full[: full.index("STOP")], "stop")
    assert drive(["😀 and"], ids) == (full[: full.index("😀 and")], "stop")
    assert drive([], ids + [eos] + ids) == (full, "stop")
    assert drive(["zzz"], ids) == (full, "length")


def test_stop_checker_rejects_empty_stop_string():
    with pytest.raises(ValueError, match="stop"):
        StopChecker(stop=["ok", ""])
